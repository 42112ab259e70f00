"""CPU: the embedded default and the test platform. Graphs are eager replays (opt-in), of
torch.compile'd forwards with --enable-torch-compile."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import torch

from srt_ascend.platforms.base import Platform, register_platform
from srt_ascend.platforms.device_worker import DeviceWorker, ThreadWorker

if TYPE_CHECKING:
    from srt_ascend.server_args import ServerArgs

# Matmuls up to 2^18 multiply-adds (this model's projections at 1-4 rows, the absorbed-MLA
# batched matmuls at one row) are 1.3-4x faster through MKL than through oneDNN on the CI
# machine; larger ones are slower (benchmark/kernels.py --cpu-gemm).
SMALL_GEMM_MACS = 1 << 18


@register_platform("cpu")
class CpuPlatform(Platform):
    name = "cpu"
    # Eager replay saves no launch overhead on CPU; --enable-cpu-graph runs it anyway.
    graphs_by_default = False
    # mode "max-autotune-no-cudagraphs" (autotuning picks AMX / AVX micro-GEMMs over oneDNN
    # for the small matmuls), the C++ wrapper (no Python between kernels) and freezing
    # (weights folded in as constants): each alone gains less (benchmark/compile.py).
    compile_options = {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "cpp_wrapper": True,
        "freezing": True,
    }
    # the same for the packages (AOTInductor's code is C++ throughout; weights are inputs,
    # not frozen constants, so a package does not depend on weight values)
    package_options = {"max_autotune": True, "coordinate_descent_tuning": True}

    @staticmethod
    def is_available() -> bool:
        return True

    def overlaps_by_default(self, server_args: ServerArgs) -> bool:
        """Only compiled forwards (`--enable-torch-compile`): their code runs without the
        GIL, while an eager forward in the device thread takes the GIL back op by op from
        the loop's threads, and overlap then costs more than the host work it hides (eager
        plain decoding at one request: 2.1x the serial loop's time per token;
        benchmark/README.md "MTP rounds under overlap scheduling"). `--enable-overlap-schedule`
        overlaps eager forwards too."""
        return server_args.enable_torch_compile

    def new_device_worker(self) -> DeviceWorker:
        """No asynchronous device: step closures run on one thread beside the scheduler's."""
        return ThreadWorker()

    def default_threads(self, ranks_on_node: int) -> int:
        """One rank leaves one of this process's cores to its other threads (HTTP, tokenizer,
        detokenizer, clients on the same machine), as vLLM's CPU backend reserves one: a
        forward's OpenMP team whose barriers wait for a thread that lost its core stalls the
        whole step (eager served TPOT 8-20x worse on 2 busy vCPUs; benchmark/README.md
        "Eager OpenMP threads"). Several ranks share the cores."""
        cores = usable_cores()
        if ranks_on_node > 1:
            return max(1, cores // ranks_on_node)
        return threads_leaving_a_core(cores, cores)

    def compiled_forward_threads(self, eager_threads: int) -> int:
        """A compiled forward's OpenMP team leaves one of this process's cores to its other
        threads (`threads_leaving_a_core`): see `model_executor/torch_compile.py`."""
        return threads_leaving_a_core(eager_threads, usable_cores())

    def small_gemm_macs(self, setting: str) -> int | None:
        on = setting == "on" or (setting == "auto" and torch.backends.mkl.is_available())
        return SMALL_GEMM_MACS if on else None

    def deterministic_unavailable(self) -> str | None:
        return None  # linear.configure(row_tile=...), the batch-invariant attention backend

    def compile_unavailable(self) -> str | None:
        names = (os.environ.get("CXX"), "g++", "clang++", "c++")
        if any(name and shutil.which(name) for name in names):
            return None
        return "no C++ compiler found (g++, clang++ or $CXX), which inductor needs on CPU"


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as OpenMP counts them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_leaving_a_core(eager_threads: int, cores: int) -> int:
    """`eager_threads`, but at most `cores` - 1, and at least 1."""
    return max(1, min(eager_threads, cores - 1))
