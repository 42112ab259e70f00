"""Flashinfer-free custom ops: one module per op, its torch reference beside its Triton kernel.

Each op module (`mla_attention`, `spec_accept`, `kv_cache`) holds the plain-torch reference,
which states the op's semantics, and a dispatcher that picks an implementation by the device
type of its tensors through a small table (`pick`): Triton on CUDA, Triton-Ascend on NPU for the
ops torch_npu has no fused op for (when the `triton` module is importable there), the reference
everywhere else. The Triton kernels live in `*_triton.py` modules, imported only when used, so
this package imports on machines without Triton. Attention on NPU stays with FIA
(`layers/attention/fia_backend.py`), which is torch_npu's fused op for it.

Triton subset (kept so that the same sources compile for CUDA and for Triton-Ascend, and run
under `TRITON_INTERPRET=1` on CPU, where the tests run them):
- loops whose bounds are read from device memory are `while` loops: Triton 3.3's interpreter
  keeps every scalar as a 1-element array, which `range()` rejects (numpy >= 2.4). A loop
  around `tl.dot` is a `for` when compiled (Triton 3.3 cannot fence Hopper's wgmma inside a
  `while`), its body a jitted helper that a `WHILE_LOOP` constexpr (the interpreter) runs in
  a `while` instead;
- values that follow a batch's lengths (row and block counts, KV parts, draft counts,
  strides of per-batch buffers, views at batch-dependent offsets) are plain arguments kept
  out of Triton's specialisation (`do_not_specialize`, `do_not_specialize_on_alignment`), so
  a server's variants are a fixed set, compiled at start (`model_executor/kernel_warmup.py`)
  and for sm_90 / sm_80 on CPU by the tests (`triton_offline.py`);
- no `tl.atomic_*`, inline PTX, `tl.make_block_ptr`/TMA descriptors, autotuning or float64:
  Ascend's vector units lack float64, its Triton has no PTX and a different block-pointer
  story, and autotuning would make results depend on the tuner's choice;
- bf16/fp16 values are converted to float32 right after loading before any arithmetic with
  a scalar (the interpreter cannot build bf16 scalars), dot products accumulate in float32.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

# The modules holding Triton kernels (imported only where used).
KERNEL_MODULES = tuple(
    f"srt_ascend.layers.ops.{m}_triton"
    for m in ("mla_attention", "kv_cache", "spec_accept", "matmul", "fp8_matmul")
)


def triton_available() -> bool:
    """Whether the `triton` module (upstream Triton or Triton-Ascend) can be imported."""
    return importlib.util.find_spec("triton") is not None


def pick(table: dict[str, Callable[[], Callable]], device: torch.device, reference: Callable):
    """The implementation for tensors on `device`: the loader registered for its device type
    in `table` (imported lazily), else `reference`."""
    loader = table.get(device.type)
    return reference if loader is None else loader()


def full_limits(limits: torch.Tensor | None, batch: int, k: int, device) -> torch.Tensor:
    """The per-row draft limits [B] int64 on `device`: `limits`, or K for every row."""
    if limits is None:
        return torch.full((batch,), k, dtype=torch.int64, device=device)
    return limits.to(device=device, dtype=torch.int64)
