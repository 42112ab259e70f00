"""What CUDA and Ascend NPU share: torch exposes both through one device-module interface
(`torch.cuda`, `torch.npu`: synchronize, Stream, stream, mem_get_info, empty_cache,
graph_pool_handle), so one class serves both, parameterised by that module and a graph class."""

from __future__ import annotations

from types import ModuleType

import torch

from srt_ascend.platforms.base import DeviceGraph, Platform
from srt_ascend.platforms.device_worker import HostCopy


class AcceleratorPlatform(Platform):
    graph_class: type[DeviceGraph]
    # Triton kernels compile at their first launch here: every variant is launched once at
    # start, before the server says ready (model_executor/kernel_warmup.py).
    compiles_kernels = True

    @property
    def module(self) -> ModuleType:
        """`torch.cuda` or `torch.npu` (registered by torch_npu on import)."""
        import torch

        return getattr(torch, self.name)

    def set_device(self, index: int) -> None:
        self.module.set_device(index)

    def synchronize(self) -> None:
        self.module.synchronize()

    def new_stream(self):
        return self.module.Stream()

    def stream(self, stream):
        return self.module.stream(stream)

    def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
        """A non-blocking copy into pinned host memory (torch's caching host allocator keeps
        the block until the copy is done) and an event recorded after it on the current
        stream: waiting on the event waits for this result, not for what is enqueued next."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        ready = self.module.Event()
        ready.record()
        return HostCopy(host, ready)

    def mem_get_info(self) -> tuple[int, int]:
        return self.module.mem_get_info()

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def new_graph(self, compiled: bool = False) -> DeviceGraph:
        return self.graph_class()

    def graph_pool_handle(self):
        return self.module.graph_pool_handle()
