"""ModelSlim's int8 linears on CPU as one fused op each (`cpu_int8.cpp`): the activations'
quantisation, the int8 GEMM (`torch._int_mm`, oneDNN's VNNI / AMX kernels) and the float
epilogue in one call, the references' exact arithmetic (`quant_matmul.py`), so the outputs are
the same bits as the torch-op path's. Per call that is one dispatch where the torch-op path
runs about a dozen small ops, which at one to a few rows cost more than the GEMM itself
(benchmark/README.md, issue 44).

Built with torch's C++ extension builder the first time a process needs it (about a minute;
cached under torch's extensions directory, `TORCH_EXTENSIONS_DIR`, for later processes). Where
it cannot be built (no C++ compiler or ninja) or `SRT_ASCEND_CPU_INT8_KERNEL=0` is set, the
int8 linears run on the torch-op path, with one warning naming the reason.
"""

from __future__ import annotations

from srt_ascend.layers.ops.cpp_ops import CppOps

ENV = "SRT_ASCEND_CPU_INT8_KERNEL"
_LIB = CppOps(
    "srt_ascend_cpu_int8", "cpu_int8.cpp", "srt_cpu_int8", ENV, "int8 linears run on torch ops"
)


def enabled() -> bool:
    return _LIB.enabled()


def configure(fused: bool) -> None:
    """Use the ops (built when next needed) or the torch path from now on, for this process
    (benchmarks compare both in one run; a server keeps the environment's choice)."""
    _LIB.configure(fused)


def ops():
    """The ops (`torch.ops.srt_cpu_int8`), built on first use; None where disabled or not buildable
    (said once)."""
    return _LIB.ops()


def unavailable() -> str | None:
    """Why the ops are not used (after `ops()` was called), or None."""
    return _LIB.unavailable()
