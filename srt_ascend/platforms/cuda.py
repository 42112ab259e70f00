"""CUDA: torch.cuda streams, memory queries and CUDA graphs."""

from __future__ import annotations

import torch

from srt_ascend.platforms.accelerator import AcceleratorPlatform
from srt_ascend.platforms.base import DeviceGraph, register_platform


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
class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    graph_class = CudaGraph
    dist_backend = "nccl"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()
