"""The model layers' matmuls (`linear`, `bmm`, and `Linear`, an nn.Linear that uses them).

On CPU PyTorch runs bf16 / fp16 matmuls through oneDNN, which costs about 30-40 us per call
on the CI machine whatever the size, while MKL computes a one- or two-row product of this
model's layers in 8-27 us (`benchmark/cpu_gemm.py`). With `configure(max_macs)` (the CPU
platform's choice, `--cpu-small-gemm`), half-precision CPU matmuls of at most `max_macs`
multiply-adds (and, for `bmm`, one row per matrix) run with oneDNN switched off, i.e. through
MKL; larger ones (the LM head, the dense-MoE expert stacks, batches of many rows), float32
ones and other devices are untouched. MKL and oneDNN both accumulate in float32; their bf16
results may differ in the last bit.

oneDNN's switch is process-wide (`torch.backends.mkldnn.enabled`); it is turned off only for
the duration of one call, from the thread that runs the model (the scheduler thread).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.bfloat16, torch.float16)
_max_macs: int | None = None  # None: PyTorch's default backend for every matmul


def configure(max_macs: int | None) -> None:
    """Route half-precision CPU matmuls of at most `max_macs` multiply-adds to MKL (None: off)."""
    global _max_macs
    _max_macs = max_macs


def small_gemm_limit() -> int | None:
    return _max_macs


def _without_onednn(fn, *args):
    mkldnn = torch.backends.mkldnn
    was = mkldnn.enabled
    mkldnn.enabled = False
    try:
        return fn(*args)
    finally:
        mkldnn.enabled = was


def _eager_limit() -> int | None:
    """The routing limit; None inside a torch.compile'd forward, whose GEMMs inductor picks."""
    return None if torch.compiler.is_compiling() else _max_macs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear, through MKL when small (see the module docstring)."""
    limit = _eager_limit()
    if limit is not None and x.dtype in _HALF and x.device.type == "cpu":
        rows = x.numel() // max(x.shape[-1], 1)
        if rows * weight.shape[0] * weight.shape[1] <= limit:
            return _without_onednn(F.linear, x, weight, bias)
    return F.linear(x, weight, bias)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, through MKL when each product has one row and all of them are small."""
    limit = _eager_limit()
    if limit is not None and a.dtype in _HALF and a.device.type == "cpu" and a.shape[1] == 1:
        if a.shape[0] * a.shape[2] * b.shape[2] <= limit:
            return _without_onednn(torch.bmm, a, b)
    return torch.bmm(a, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
