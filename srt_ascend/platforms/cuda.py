"""CUDA: torch.cuda streams, memory queries and CUDA graphs."""

from __future__ import annotations

import torch

from srt_ascend.platforms.base import DeviceGraph, Platform, register_platform


class CudaGraph(DeviceGraph):
    supports_host_params = False  # host lists are baked in: FIA verify stays eager on CUDA

    def capture(self, fn, pool, stream):
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool, stream=stream):
            out = fn()
        return out

    def replay(self, host_params=None):
        self._graph.replay()


@register_platform("cuda")
class CudaPlatform(Platform):
    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def new_stream(self):
        return torch.cuda.Stream()

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def new_graph(self) -> DeviceGraph:
        return CudaGraph()

    def graph_pool_handle(self):
        return torch.cuda.graph_pool_handle()
