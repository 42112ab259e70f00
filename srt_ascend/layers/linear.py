"""The model layers' matmuls (`linear`, `bmm`, and `Linear`, an nn.Linear that uses them).

On CPU PyTorch runs bf16 / fp16 matmuls through oneDNN, which costs about 30-40 us per call
on the CI machine whatever the size, while MKL computes a one- or two-row product of this
model's layers in 8-27 us (`benchmark/kernels.py --cpu-gemm`). With `configure(max_macs)` (the
CPU platform's choice, `--cpu-small-gemm`), half-precision CPU matmuls of at most `max_macs`
multiply-adds (and, for `bmm`, one row per matrix) run with oneDNN switched off, i.e. through
MKL; larger ones (the LM head, the dense-MoE expert stacks, batches of many rows), float32
ones and other devices are untouched. MKL and oneDNN both accumulate in float32; their bf16
results may differ in the last bit.

oneDNN's switch is process-wide (`torch.backends.mkldnn.enabled`); it is turned off only for
the duration of one call, from the thread that runs the model (the scheduler thread).

Batch-invariant mode (`configure(..., row_tile=n)`, `--enable-deterministic-inference`): a
GEMM's kernel, and with it each output's reduction order, may follow the number of rows (oneDNN
computes a 102-row bf16 product's last rows with another kernel than the same rows inside a
2228-row product, so they differ in the last bit; MKL's float32 GEMM takes a GEMV kernel for
one row). In this mode every CPU `linear` and `bmm`, whatever its dtype, runs under its
layout's `row_plan.RowPlan`: calls of at most 16-64 rows that a one-off probe found
row-invariant for every call size and row position, or fixed tiles of exactly `n` rows (zero
padded) where no plan holds; so a row's result depends on that row alone. A bf16 `linear` of a
weight of at most FIXED_ORDER_MAX_WEIGHT elements runs on the fixed-order C++ kernel
(`ops/cpu_bf16`: one reduction order over K for every row count, so no plan, and a one-row
call costs about its weight's read, a third of oneDNN's per-call cost at this model's sizes);
a larger one on its weight's oneDNN-prepacked copy (`onednn_packed`: one kernel family for
every row count, without the per-call weight reorder of a plain call), its plan probed on that
op; which one is a constant of the layer (its shape, whether the kernel built). The MKL
routing above is off in this mode: its switch is process-wide, and a call of another thread
that ran on the other library would change its bits.
On CUDA the mode runs `linear` and `bmm` through the fixed-tile Triton GEMM instead
(`ops/matmul_triton.py`: one tile shape, no split-K, the reduction in fixed steps), and
`ordered_sum` / `sum_last` replace the reductions whose CUDA kernel's order follows the row
count (the MoE's short sums; the sampler's sums over the vocabulary).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.layers import onednn_packed, row_plan
from srt_ascend.layers.ops import cpu_bf16

_HALF = (torch.bfloat16, torch.float16)
_max_macs: int | None = None  # None: PyTorch's default backend for every matmul
_row_tile: int | None = None  # batch-invariant mode: rows per GEMM call (None: off)
# The row tile of --enable-deterministic-inference: elementwise ops' padding, and the GEMMs'
# fixed tile where no probed row plan holds (row_plan.FIXED_TILE).
DETERMINISTIC_ROW_TILE = row_plan.FIXED_TILE.max_rows
# Batch-invariant mode: bf16 weights of at most this many elements run on the fixed-order C++
# kernel (`ops/cpu_bf16`) for every row count; larger ones on oneDNN's prepacked copy.
# The kernel's float32 path (tested) is not used by the mode yet: with the bf16 model's router
# on it (a float32 copy of its weight packed per call) two runs measured 16 requests with MTP
# K = 2 at 0.84x where the bf16-only choice had 0.92x (benchmark/README.md, issue 46).
_FIXED_ORDER_DTYPES = (torch.bfloat16,)
FIXED_ORDER_MAX_WEIGHT = int(os.environ.get("SRT_ASCEND_FIXED_ORDER_MAX_WEIGHT", 1 << 18))


def configure(max_macs: int | None, row_tile: int | None = None) -> None:
    """Route half-precision CPU matmuls of at most `max_macs` multiply-adds to MKL (None: off);
    with `row_tile`, batch-invariant mode: CPU matmuls under probed row plans, elementwise
    ops padded to `row_tile` rows (module docstring). Process-wide; set once by the model
    runner before the first forward."""
    global _max_macs, _row_tile
    if row_tile is not None and row_tile < 1:
        raise ValueError(f"row_tile must be >= 1, got {row_tile}")
    _max_macs, _row_tile = max_macs, row_tile


def small_gemm_limit() -> int | None:
    return _max_macs


def row_tile() -> int | None:
    """Rows per GEMM call in batch-invariant mode; None when the mode is off."""
    return _row_tile


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


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """F.linear, through MKL when a product of `rows` rows is small (module docstring)."""
    limit = _eager_limit()
    if limit is not None and x.dtype in _HALF and x.device.type == "cpu":
        if rows * weight.shape[0] * weight.shape[1] <= limit:
            return _without_onednn(F.linear, x, weight, bias)
    return F.linear(x, weight, bias)


def _batch_invariant(x: torch.Tensor) -> int | None:
    """The row tile when this CPU matmul must not depend on its row count, else None."""
    return _row_tile if x.device.type == "cpu" and not torch.compiler.is_compiling() else None


def _invariant_gemm(x: torch.Tensor):
    """The batch-invariant Triton GEMM module when this matmul runs on CUDA in batch-invariant
    mode, else None."""
    if _row_tile is None or x.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    from srt_ascend.layers.ops import matmul_triton

    return matmul_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear, through MKL when small; in batch-invariant mode under the layout's row plan
    (see the module docstring)."""
    if (gemm := _invariant_gemm(x)) is not None:
        return gemm.linear(x, weight, bias)
    if _batch_invariant(x) is None:
        return _linear_rows(x, weight, bias, x.numel() // max(x.shape[-1], 1))
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if (fixed := _fixed_order_weight(flat, weight)) is not None:
        out = cpu_bf16.linear(flat, fixed, weight.shape[0], bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    packed = onednn_packed.packed_weight(weight) if flat.dtype == weight.dtype else None
    if packed is not None:
        plan = row_plan.linear_plan(flat, weight, bias, packed=True)
        out = plan.run(lambda rows: onednn_packed.linear(rows, packed, bias), flat, 0)
    else:
        plan = row_plan.linear_plan(flat, weight, bias)
        out = plan.run(lambda rows: F.linear(rows, weight, bias), flat, 0)
    return out.view(*x.shape[:-1], weight.shape[0])


def prepare_fixed_order() -> None:
    """Builds / loads the fixed-order kernel now (model load in batch-invariant mode on CPU),
    not in the first step; where it cannot be built the mode's bf16 linears stay on oneDNN."""
    if FIXED_ORDER_MAX_WEIGHT > 0:
        cpu_bf16.ops()


def fixed_order_covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether batch-invariant mode runs `linear(x, weight)` on the fixed-order kernel
    (`ops/cpu_bf16`): bf16 on CPU, a weight of at most FIXED_ORDER_MAX_WEIGHT
    elements, the kernel built. A constant of the layer, never of the row count."""
    if _batch_invariant(x) is None or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if x.dtype not in _FIXED_ORDER_DTYPES or weight.dtype != x.dtype:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the op has no backward: a graph being recorded stays on oneDNN
    return weight.numel() <= FIXED_ORDER_MAX_WEIGHT and cpu_bf16.ops() is not None


def _fixed_order_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The `cpu_bf16` packing of weight (built once per weight, `onednn_packed.derived`)
    where `fixed_order_covers`; None where the layer stays on oneDNN's prepacked path."""
    if not fixed_order_covers(x, weight):
        return None
    key = ("cpu_bf16", weight.data_ptr(), tuple(weight.shape), weight.stride())
    return onednn_packed.derived(weight, key, lambda: cpu_bf16.pack(weight))


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, through MKL when each product has one row and all of them are small; in
    batch-invariant mode under the layout's row plan over a's rows (dim 1)."""
    if (gemm := _invariant_gemm(a)) is not None:
        return gemm.bmm(a, b)
    if _batch_invariant(a) is not None:
        a = a.contiguous()
        return row_plan.bmm_plan(a, b).run(lambda rows: torch.bmm(rows, b), a, 1)
    limit = _eager_limit()
    if limit is not None and a.dtype in _HALF and a.device.type == "cpu" and a.shape[1] == 1:
        if a.shape[0] * a.shape[2] * b.shape[2] <= limit:
            return _without_onednn(torch.bmm, a, b)
    return torch.bmm(a, b)


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, in batch-invariant mode over x's rows zero-padded to the
    row tile. PyTorch's CPU loops compute a contiguous tensor's elements in vector steps and
    its last few (under 2 vector widths) with scalar code; vector and scalar exp-based
    functions (sigmoid, silu) may differ in the last bit, so a row's result would follow how
    many rows come before it. With the rows padded to a multiple of 16, a tensor of even row
    width has no scalar tail. Use where the row width can be small (the MoE router's scores);
    elsewhere widths are large multiples of 32."""
    tile = _batch_invariant(x)
    n = x.shape[0]
    if tile is None or not n % tile:
        return fn(x)
    return fn(F.pad(x, [0, 0] * (x.dim() - 1) + [0, -n % tile]))[:n]


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim); in batch-invariant mode off the CPU, the slices along `dim` added one by
    one in index order. CUDA's reduction kernel picks how many threads (and blocks) share one
    output by the number of outputs, so a short sum (a token's k routing weights, its experts'
    outputs) is added in another order in a 1-token step than in a 300-token one. The CPU's
    loops add along `dim` in one order whatever the other sizes (tests/unit/test_batch_invariant
    checks the MoE's)."""
    if _row_tile is None or x.device.type == "cpu" or torch.compiler.is_compiling():
        return x.sum(dim)
    parts = x.unbind(dim)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True); in batch-invariant mode on CUDA a product with a ones column
    through the fixed-tile GEMM (the row reduced in fixed 32-wide steps). CUDA's reduction
    kernel spreads a long row's sum (a vocabulary's probabilities) over more threads and
    blocks when there are few rows, so a row's sum would follow the batch."""
    if (gemm := _invariant_gemm(x)) is not None:
        return gemm.linear(x, x.new_ones(1, x.shape[-1]))
    return x.sum(-1, keepdim=True)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
