"""Row plans of the batch-invariant CPU matmuls (`linear.linear` and `linear.bmm` under
`--enable-deterministic-inference`).

A row's result must not depend on the other rows of its call. A fixed tile (every call exactly
16 rows, zero-padded) guarantees it whatever the kernel does, but a one-row decode step then
pays a padded call, a pad and a concatenation per matmul. Most CPU kernels already compute a
row's dot products in one order whatever the row count up to some size (oneDNN's bf16 GEMMs
on AVX-512/AMX did for every layer shape of the shipped checkpoint, 1..64 rows, one thread),
and others do not (MKL's float32 GEMM takes a GEMV kernel for one row, and its GEMM kernel
changes past 8 rows). So each matmul's layout gets a `RowPlan` from a one-off probe: the
widest candidate under which every call size up to `max_rows` (those under `min_rows`
zero-padded), at every row position, gives each row exactly the bits of that row alone; the
fixed tile when none holds.

The probe's operands cancel exactly (`cancelling`), so a kernel's result is its own rounding
error, which another reduction order changes far above the output's last bit. A plan is keyed by
everything the kernel's choice can follow: the op, the weight's shape, strides and alignment,
the dtypes, whether a bias is added, and the calling thread's intra-op thread count. Plans are
computed on first use (the first forward; kernel warm-up reaches every layer) and cached for
the process; a probe costs a few hundred small matmuls per layout (for the shipped
checkpoint's 11 layouts: 0.8 s of CPU on one thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt_ascend.layers import onednn_packed

Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RowPlan:
    """Calls of at most `max_rows` rows, each zero-padded to at least `min_rows` rows."""

    min_rows: int
    max_rows: int

    def run(self, fn: Matmul, x: torch.Tensor, dim: int) -> torch.Tensor:
        """fn over x's rows (along `dim`) in calls that follow this plan, concatenated back.
        fn maps rows to rows one to one (a GEMM with x, contiguous, on the left); every call gets a
        contiguous tensor, as the probe's calls do."""
        n = x.shape[dim]
        if self.min_rows <= n <= self.max_rows:
            return fn(x)
        parts = [self._call(fn, part.contiguous(), dim) for part in x.split(self.max_rows, dim)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def _call(self, fn: Matmul, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """One call; rows padded with zeros to min_rows and the padding's outputs dropped."""
        n = rows.shape[dim]
        if n >= self.min_rows:
            return fn(rows)
        widths = [0, 0] * (rows.dim() - 1 - dim) + [0, self.min_rows - n]
        return fn(F.pad(rows, widths)).narrow(dim, 0, n)


# Tried widest first; FIXED_TILE needs no probe (every call has the same shape). The two-row
# minimum serves kernels that take a GEMV path for one row (MKL's float32 GEMM: the router;
# oneDNN's bf16 bmm at K = 32: q_nope x W_UK), whose GEMM path then holds up to 8-16 rows.
CANDIDATES = (RowPlan(1, 64), RowPlan(1, 32), RowPlan(1, 16), RowPlan(2, 16), RowPlan(2, 8))
FIXED_TILE = RowPlan(16, 16)
# Weights of more elements keep FIXED_TILE unprobed: a probe copies the weight and runs a few
# hundred calls on it (DeepSeek-V3's LM head, 129280 x 7168, would take seconds and 2 GB).
PROBE_MAX_WEIGHT = 1 << 24

_plans: dict[tuple, RowPlan] = {}
_lock = threading.Lock()


def cancelling(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, k_dim: int = -1, sign: float = 1.0
) -> torch.Tensor:
    """Random values, normal times 2^-8..2^8 (exact in bf16), whose second half along the
    reduction dim `k_dim` repeats the first times `sign`. A product of an x with sign 1 and a
    weight with sign -1 is then exactly zero, so what a kernel returns is its rounding error:
    partial sums of up to 2^16 that lose their low bits in an order the kernel chose. Two
    orders give different results far above the output's last bit, bf16 outputs included
    (random operands would differ in float32's last bits, mostly lost to bf16 rounding)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    values = torch.randn(shape, generator=g) * scale
    half = shape[k_dim] // 2
    values.narrow(k_dim, half, half).copy_(values.narrow(k_dim, 0, half) * sign)
    return values.to(dtype)


def like(t: torch.Tensor, seed: int, k_dim: int, sign: float) -> torch.Tensor:
    """`cancelling` values laid out as t: same shape, strides, dtype and address modulo 64."""
    elt = t.element_size()
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    buf = torch.empty(span + 64 // elt, dtype=t.dtype)
    shift = (t.data_ptr() % 64 - buf.data_ptr() % 64) % 64 // elt
    out = buf.as_strided(t.shape, t.stride(), shift)
    return out.copy_(cancelling(tuple(t.shape), t.dtype, seed, k_dim, sign))


def holds(plan: RowPlan, fn: Matmul, x: torch.Tensor, dim: int) -> bool:
    """Whether every call size 1..plan.max_rows at every row position gives each row of x
    (plan.max_rows rows along `dim`) the bits of that row computed alone under the plan."""
    m = plan.max_rows
    rows = [x.narrow(dim, i, 1).contiguous() for i in range(m)]
    alone = torch.cat([plan.run(fn, row, dim) for row in rows], dim)
    for size in range(2, m + 1):
        for start in {0, m - size}:
            got = plan.run(fn, x.narrow(dim, start, size).contiguous(), dim)
            if not torch.equal(got, alone.narrow(dim, start, size)):
                return False
    return True


def choose(
    key: tuple, probe: Callable[[int], tuple[Matmul, torch.Tensor, int]], weight_numel: int = 0
) -> RowPlan:
    """The cached plan of `key`, else the widest candidate that `probe(rows)` (a matmul over
    cancelling operands, its rows and their dim) shows to be row-invariant; FIXED_TILE where
    none holds or the weight is past PROBE_MAX_WEIGHT elements."""
    plan = _plans.get(key)
    if plan is not None:
        return plan
    plan = FIXED_TILE
    with torch.inference_mode():
        for candidate in CANDIDATES if weight_numel <= PROBE_MAX_WEIGHT else ():
            fn, x, dim = probe(candidate.max_rows)
            if holds(candidate, fn, x, dim):
                plan = candidate
                break
    with _lock:
        return _plans.setdefault(key, plan)


def linear_plan(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = False
) -> RowPlan:
    """The plan of F.linear(x rows, weight, bias), or with `packed` of its oneDNN-prepacked
    form (`onednn_packed.linear`); x [rows, K] contiguous."""
    threads = torch.get_num_threads()
    op = "linear_packed" if packed else "linear"
    key = (op, tuple(weight.shape), weight.stride(), weight.data_ptr() % 64, x.dtype)
    key += (weight.dtype, None if bias is None else bias.dtype, threads)

    def probe(rows: int):
        w = like(weight, 1, 1, -1.0)
        b = None if bias is None else torch.zeros_like(bias)  # the error is the result
        x_probe = cancelling((rows, weight.shape[1]), x.dtype, 3)
        if packed:
            w_packed = onednn_packed.pack(w)
            return (lambda r: onednn_packed.linear(r, w_packed, b)), x_probe, 0
        return (lambda r: F.linear(r, w, b)), x_probe, 0

    return choose(key, probe, weight.numel())


def bmm_plan(a: torch.Tensor, b: torch.Tensor) -> RowPlan:
    """The plan of torch.bmm(a rows, b) over a's dim 1; a [B, rows, K] contiguous."""
    key = ("bmm", tuple(b.shape), b.stride(), b.data_ptr() % 64, a.dtype, b.dtype)
    key += (torch.get_num_threads(),)

    def probe(rows: int):
        b_probe = like(b, 4, 1, -1.0)
        a_probe = cancelling((b.shape[0], rows, b.shape[1]), a.dtype, 5)
        return (lambda r: torch.bmm(r, b_probe)), a_probe, 1

    return choose(key, probe, b.numel())


def cached_plans() -> dict[tuple, RowPlan]:
    """A copy of the plans chosen so far (tests, benchmarks)."""
    with _lock:
        return dict(_plans)
