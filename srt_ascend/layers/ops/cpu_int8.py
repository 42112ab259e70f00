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

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

ENV = "SRT_ASCEND_CPU_INT8_KERNEL"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_int8.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the op namespace, or "why": why it is not used


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def configure(fused: bool) -> None:
    """Use the fused ops (built when next needed) or the torch-op path from now on, for this
    process (benchmarks compare both in one run; a server keeps the environment's choice)."""
    with _lock:
        _state.clear()
        if not fused:
            _state["why"] = "configured off"


def _build():
    from torch.utils import cpp_extension

    logger.info("loading the fused CPU int8 ops (cpu_int8.cpp; built on a first start, ~10-60 s)")
    cpp_extension.load(
        name="srt_ascend_cpu_int8",
        sources=[_SOURCE],
        extra_cflags=["-O3"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.srt_cpu_int8


def ops():
    """The fused ops (`torch.ops.srt_cpu_int8`), built on first use; None where they are
    disabled or cannot be built (then the torch-op path serves, with one warning)."""
    if "ops" in _state or "why" in _state:
        return _state.get("ops")
    with _lock:
        if "ops" in _state or "why" in _state:
            return _state.get("ops")
        if not enabled():
            _state["why"] = f"{ENV}=0"
            return None
        try:
            _state["ops"] = _build()
        except Exception as e:  # noqa: BLE001 - any build failure falls back, said once
            _state["why"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning(
                "fused CPU int8 kernel unavailable (%s); int8 linears run on torch ops",
                _state["why"],
            )
    return _state.get("ops")


def unavailable() -> str | None:
    """Why the fused ops are not used (after `ops()` was called), or None."""
    return _state.get("why")
