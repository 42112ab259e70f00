"""Ascend NPU through torch_npu, imported only when this platform is chosen.

Graphs are aclgraphs (`torch.npu.NPUGraph`). They are captured with torch_npu's
`auto_dispatch_capture`, which records `npu_fused_infer_attention_score` as an updatable task;
`NPUGraph.update` then refreshes its host-side `actual_seq_lengths` / `actual_seq_lengths_kv`
before each replay (torch_npu >= 2.13, torch_npu/npu/_npugraph_handlers/ifa_handler.py).

--enable-torch-compile goes through torchair, torch_npu's torch.compile backend (GE graph
mode); the compiled forward is the device graph, replayed by calling it. NOT YET RUN ON AN NPU:
wired through the platform hooks only (no Ascend device where this is tested).
"""

from __future__ import annotations

import importlib.util

import torch

from srt_ascend.platforms.accelerator import AcceleratorPlatform
from srt_ascend.platforms.base import DeviceGraph, EagerReplayGraph, register_platform


def _import_torch_npu() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:  # CANN missing or broken: torch_npu raises various errors at import
        return False
    return True


class AclGraph(DeviceGraph):
    supports_host_params = True

    def capture(self, fn, pool, stream):
        self._graph = torch.npu.NPUGraph()
        with torch.npu.graph(self._graph, pool=pool, stream=stream, auto_dispatch_capture=True):
            self._out = fn()
        return self._out

    def replay(self, host_params=None):
        if host_params:
            self._graph.update(cpu_update_input=[host_params])
        self._graph.replay()
        return self._out


@register_platform("npu")
class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    graph_class = AclGraph
    dist_backend = "hccl"

    @staticmethod
    def is_available() -> bool:
        return _import_torch_npu() and torch.npu.is_available()

    def deterministic_unavailable(self) -> str | None:
        return (
            "torch_npu's npu_fused_infer_attention_score (FIA) and its matmuls have no "
            "fixed-order (batch-invariant) variant"
        )

    def new_graph(self, compiled: bool = False) -> DeviceGraph:
        """A torchair-compiled forward runs as a GE graph already: replayed by calling it."""
        return EagerReplayGraph() if compiled else AclGraph()

    def compile_unavailable(self) -> str | None:
        if importlib.util.find_spec("torchair") is None:
            return "torchair (torch_npu's torch.compile backend) is not installed"
        return None

    def compile(self, fn):
        """Untested here (see the module docstring)."""
        import torchair

        backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
