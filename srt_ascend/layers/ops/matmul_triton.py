"""Batch-invariant GEMM in Triton: `linear` and `bmm` of `--enable-deterministic-inference` on
CUDA (`layers/linear.py` routes there).

cuBLAS picks its kernel, tile and split-K factor by the problem's shape, so the same row of
`x @ w.T` is reduced in another order inside a 1-row decode than inside a 300-row prefill and
differs in the last bits. Here the launch constants are fixed: every program computes one
BLOCK_M x BLOCK_N tile of the output, walking the whole reduction dimension in BLOCK_K steps
from 0 upwards with one float32 accumulator (no split-K, no autotuning, no stream-K). Output
element (r, c) is therefore the same sequence of BLOCK_K-wide dots, added in the same order,
whatever M is and wherever row r falls: a function of row r of `a` and column c of `b` alone.
The row count only changes how many programs run.

bf16 / fp16 operands use tensor-core dots accumulating in float32, float32 ones true float32
products (`input_precision="ieee"`, not TF32); the bias is added in float32 before the one
rounding to the output dtype (as cuBLAS's epilogue does). Under the interpreter half-precision
dots go through float32 (Triton 3.3 computes them wrongly there), as the attention kernel does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# TRITON_INTERPRET is read by `triton.jit` when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The fixed tiles: 64 x 64 outputs per program, 32-wide reduction steps. Shared memory per
# step (bf16): a [64, 32] + b [32, 64] = 8 KiB (fp32: 16 KiB), double-buffered by the
# pipeliner; accumulator 64 x 64 fp32 = 32 registers per thread at 4 warps.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _gemm_step(a_rows, b_cols, acc, offs_m, offs_n, k, M, N, K, stride_ak, stride_bk,
               LOW_PRECISION_DOT: tl.constexpr):  # fmt: skip
    """acc + a[:, k] @ b[k, :] for one BLOCK_K-wide slice `k` of the reduction."""
    a = tl.load(
        a_rows + k[None, :] * stride_ak,
        mask=(offs_m[:, None] < M) & (k[None, :] < K),
        other=0.0,
    )
    b = tl.load(
        b_cols + k[:, None] * stride_bk,
        mask=(k[:, None] < K) & (offs_n[None, :] < N),
        other=0.0,
    )
    if LOW_PRECISION_DOT:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


# M (the rows: the batch's tokens) is never specialised: Triton would compile a variant for
# M = 1 (a one-token decode) and another for multiples of 16. The reduction's step count is a
# plain argument too, so one variant serves every weight of a dtype (and bias or none).
@triton.jit(do_not_specialize=["M", "num_k"])
def _bmm_kernel(
    a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K, num_k,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am
    b_cols = b_ptr + batch * stride_bb + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if WHILE_LOOP:  # the interpreter: its range() rejects a bound passed as an argument
        step = 0
        while step < num_k:
            acc = _gemm_step(a_rows, b_cols, acc, offs_m, offs_n, step * BLOCK_K + offs_k,
                             M, N, K, stride_ak, stride_bk, LOW_PRECISION_DOT)  # fmt: skip
            step += 1
    else:  # a `for`, software-pipelined (and Hopper's wgmma needs one, not a `while`)
        for step in range(0, num_k):
            acc = _gemm_step(a_rows, b_cols, acc, offs_m, offs_n, step * BLOCK_K + offs_k,
                             M, N, K, stride_ak, stride_bk, LOW_PRECISION_DOT)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + batch * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def _launch(a, b, bias, out, strides_a, strides_b) -> torch.Tensor:
    """out [B, M, N] = a [B, M, K] @ b [B, K, N] (+ bias [N]) over the fixed tiles; a and b
    given by their pointers and (batch, row, column) strides."""
    batch, m, n = out.shape
    k = a.shape[-1]
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), batch)
    low_precision = a.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    _bmm_kernel[grid](
        a, b, out if bias is None else bias, out, m, n, k, triton.cdiv(k, BLOCK_K),
        *strides_a, *strides_b, *out.stride(),
        HAS_BIAS=bias is not None, LOW_PRECISION_DOT=low_precision, WHILE_LOOP=INTERPRETED,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias) (x [..., K], weight [N, K]), batch-invariant: a row's output
    does not depend on how many rows x has (module docstring)."""
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype}, weight {weight.dtype}")
    flat = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    out = torch.empty(1, flat.shape[0], n, dtype=x.dtype, device=x.device)
    _launch(
        flat,
        weight,
        bias,
        out,
        (0, flat.stride(0), flat.stride(1)),
        (0, weight.stride(1), weight.stride(0)),  # weight.T as [K, N]
    )
    return out.view(*x.shape[:-1], n)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a [B, M, K], b [B, K, N]), batch-invariant along M (module docstring); b may
    be any strided view (a transposed weight stack)."""
    if a.dtype != b.dtype:
        raise ValueError(f"bmm: a is {a.dtype}, b {b.dtype}")
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return _launch(a, b, None, out, a.stride(), b.stride())
