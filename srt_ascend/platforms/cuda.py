"""CUDA: torch.cuda streams, memory queries and CUDA graphs."""

from __future__ import annotations

import functools

import torch

from srt_ascend.platforms.accelerator import AcceleratorPlatform
from srt_ascend.platforms.base import DeviceGraph, register_platform


class CudaGraph(DeviceGraph):
    supports_host_params = False  # host lists are baked in: FIA verify stays eager on CUDA

    def capture(self, fn, pool, stream):
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool, stream=stream):
            self._out = fn()
        return self._out

    def replay(self, host_params=None):
        self._graph.replay()
        return self._out


@register_platform("cuda")
class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    graph_class = CudaGraph
    dist_backend = "nccl"
    # mode "max-autotune-no-cudagraphs" (SGLang's): the graph runner captures the compiled
    # forward in its own CUDA graph, sharing the pool and the padding rules.
    compile_options = {"max_autotune": True, "coordinate_descent_tuning": True}

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def deterministic_unavailable(self) -> str | None:
        # the fixed-tile Triton GEMM (layers/ops/matmul_triton.py), the triton attention
        # backend's batch-invariant variant, ordered small sums (linear.ordered_sum)
        return None


@functools.lru_cache(maxsize=16)
def cuda_capability(index: int) -> int:
    """Device `index`'s compute capability as one number (90 for sm_90), asked once."""
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor
