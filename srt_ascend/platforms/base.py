"""The device interface: one small class per device, plus the graph interface it hands out.

A Platform answers everything device-specific the runtime needs: the torch device,
synchronisation, streams, memory queries, and the graph class with its memory pool. Nothing
outside `srt_ascend.platforms` branches on the device.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from srt_ascend.platforms.device_worker import DeviceWorker, HostCopy, InlineWorker
from srt_ascend.registry import Registry

if TYPE_CHECKING:
    from srt_ascend.server_args import ServerArgs

PLATFORMS: Registry[Platform] = Registry("device")
register_platform = PLATFORMS.register


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used here; the message is one line for the CLI."""


Outputs = tuple[torch.Tensor, ...]  # what a captured forward returns


class DeviceGraph(ABC):
    """One captured forward. `capture` runs `fn` once under capture and returns its output
    tensors; `replay` re-runs the captured work and returns its outputs: on a device graph
    the captured tensors, written again (`outputs_reused`: a caller that keeps a result past
    the next replay copies it), on the CPU stand-in fresh tensors.

    Host-side parameters (Python lists handed to an op, such as FIA's sequence lengths) are
    baked into a device graph at capture. A graph class that can refresh them says so with
    `supports_host_params`; `replay(host_params)` then passes the new values."""

    supports_host_params: bool = False
    outputs_reused: bool = True
    warmup_runs: int = 2  # eager runs before capture (lazy kernels, workspaces)

    @abstractmethod
    def capture(self, fn: Callable[[], Outputs], pool, stream) -> Outputs: ...

    @abstractmethod
    def replay(self, host_params: dict[str, list[int]] | None = None) -> Outputs: ...


class EagerReplayGraph(DeviceGraph):
    """CPU stand-in: "replay" runs the captured function again over the same static buffers
    and returns what it returns, so capture/pad/replay logic is shared with the device
    graphs. Host parameters are read afresh on every run. It keeps no output of its own
    (a forward's logits are [tokens, vocab] floats: every captured shape would hold some),
    and capture runs nothing (returns None): an eager forward per captured shape would only
    slow the start (about 70 shapes for the default buckets: 15 s on 2 loaded cores). The
    graph runner runs a compiled forward once itself, so that it compiles at capture."""

    supports_host_params = True
    outputs_reused = False
    warmup_runs = 0

    def capture(self, fn, pool, stream):
        self._fn = fn

    def replay(self, host_params=None):
        return self._fn()


class Platform(ABC):
    name: str
    graphs_by_default = True  # capture decode/verify/draft forwards unless disabled
    compiles_kernels = False  # whether ops launch kernels that compile on first use
    dist_backend = "gloo"  # torch.distributed backend of the tensor collectives

    def set_device(self, index: int) -> None:  # noqa: B027 - one CPU device
        """Makes device `index` of this type the one `device` names (a rank's own device)."""

    def small_gemm_macs(self, setting: str) -> int | None:
        """Multiply-adds up to which half-precision matmuls skip oneDNN (`layers.linear`) for
        `--cpu-small-gemm` = auto / on / off; None: every matmul as PyTorch picks. Only the
        CPU platform has a choice to make."""
        return None

    def deterministic_unavailable(self) -> str | None:
        """Why `--enable-deterministic-inference` cannot hold on this platform (one line naming
        the op without a fixed-order variant), or None where it is served."""
        return "no batch-invariant kernels for this platform"

    @staticmethod
    @abstractmethod
    def is_available() -> bool: ...

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def synchronize(self) -> None:  # noqa: B027 - CPU work is synchronous
        pass

    # streams ---------------------------------------------------------------------------
    def new_stream(self):
        return None

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def overlaps_by_default(self, server_args: ServerArgs) -> bool:
        """Whether decode steps overlap unless `--disable-overlap-schedule` is given: on a
        device whose streams run asynchronously to the host."""
        return True

    def new_device_worker(self) -> DeviceWorker:
        """Where the overlap scheduler's step closures run (`platforms/device_worker.py`):
        inline on a device whose streams run asynchronously to the host."""
        return InlineWorker()

    def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Starts `tensor`'s way to the host, ordered after the work enqueued so far and
        before any enqueued later (`HostCopy`). CPU: the tensor itself, nothing copied."""
        return HostCopy(tensor)

    # memory ----------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV pool is carved from."""
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    def total_memory_bytes(self) -> int:
        return self.mem_get_info()[1]

    def empty_cache(self) -> None:  # noqa: B027 - nothing cached on CPU
        pass

    # graphs ----------------------------------------------------------------------------
    def new_graph(self, compiled: bool = False) -> DeviceGraph:
        """The graph a forward is captured in; `compiled`: a torch.compile'd forward."""
        return EagerReplayGraph()

    def graph_pool_handle(self):
        """One memory pool shared by every graph captured in this process."""
        return None

    # torch.compile (--enable-torch-compile) ------------------------------------------------
    # Inductor options of this device's compiled forwards (torch.compile takes a mode or
    # options, not both: these spell out the mode they stand for).
    compile_options: dict[str, object] = {}
    # Inductor options of the AOTInductor packages a warm start loads compiled shapes from
    # (model_executor/compile_packages.py); None: this device compiles at every start.
    package_options: dict[str, object] | None = None

    def compile_unavailable(self) -> str | None:
        """Why forwards cannot be compiled here (one line for a warning), or None."""
        return None

    def default_threads(self, ranks_on_node: int) -> int | None:
        """Intra-op (OpenMP) threads of a rank when `--num-threads` is not given, with
        `ranks_on_node` ranks of the server on this node; None: torch's default. Ranks of a
        node share its cores."""
        if ranks_on_node > 1:
            return max(1, (os.cpu_count() or 1) // ranks_on_node)
        return None

    def compiled_forward_threads(self, eager_threads: int) -> int | None:
        """Intra-op (OpenMP) threads a compiled forward runs with when eager ops run with
        `eager_threads`; None: the same (devices whose kernels do not run on host threads)."""
        return None

    def compile(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """`fn` compiled whole (fullgraph: a graph break is an error, not a slow path) for
        the shapes it has now (dynamic=False); compilation happens at the first call."""
        return torch.compile(fn, fullgraph=True, dynamic=False, options=dict(self.compile_options))
