"""DeepSeek's block-FP8 GEMM in Triton: `fp8_block_linear` on CUDA (`quant_matmul` routes there).

A = the activations quantised per token per 128 channels (fp8 [M, K], scales float32 [M,
ceil(K/128)]: `quantize_groups`, one launch giving `quant_matmul.quantize_fp8_groups`'s bits,
where Triton stores fp8 (sm_89+); that function's torch ops on sm_80), B = the weight as on
disk (float8_e4m3fn [N, K], `weight_scale_inv` float32 [ceil(N/bn), ceil(K/128)]). Each program
computes one BLOCK_M x BLOCK_N tile of the output; BLOCK_N divides the weight block's rows, so
a tile reads one scale row. The K loop walks the 128-wide blocks from 0 upwards: per block one
fp8 x fp8 dot accumulated in float32 (products of e4m3 values are exact in float32), times
a_scale[m, kb] * w_scale_inv[nb, kb], added to the float32 accumulator - the format's formula
(`quant_matmul.fp8_block_reference`) up to float32 summation order inside a block. Output in
the activation's dtype. N or K not multiples of the tile are masked (zeros past the edge).

The dot: sm_89 / sm_90 have fp8 MMA (`tl.dot` on float8e4nv); sm_80 has none, and Triton
3.3 refuses float8e4nv there altogether, so the kernel reads the operands' bits (uint8 views)
and decodes them to float16 in registers (`_e4m3_bits_to_fp16`: a shift, exact, subnormals
included, each value scaled by 2^-8) for a float16 MMA; products of 4-bit significands are
exact in float32 either way, and the dot is multiplied back by 2^16. Each K block's dot
starts from zero and is promoted to the float32 accumulator after its 128 products: on
Hopper the in-block sum is the tensor core's fp8 accumulator (Triton's default for fp8 dots
there), which is DeepSeek-V3's own recipe (promotion to float32 every 128 K elements).
Under the interpreter (`TRITON_INTERPRET=1`, the CPU tests) both paths run: fp8 loads and an
fp8 `tl.dot` (which the interpreter computes in float32 from exact float16 copies), and the
bit decoding with its float16 dot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# TRITON_INTERPRET is read by `triton.jit` when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The fixed tile: 64 x 128 outputs per program, the K loop in 128-wide (one scale) steps.
# Shared memory per stage: a [64, 128] + b [128, 128] fp8 = 24 KiB; 3 stages 72 KiB (within
# sm_86/89's 99 KiB); accumulator 64 x 128 fp32 = 32 registers per thread at 8 warps (at 4
# warps sm_80's float16 path spilled: 255 registers and an 8-byte stack).
BLOCK_M = 64
BLOCK_N = 128
BLOCK_K = 128
NUM_WARPS = 8
NUM_STAGES = 3
FP8_MMA_CAPABILITY = 89  # sm_89 (Ada) and sm_90 (Hopper) have fp8 tensor-core dots


@triton.jit
def _e4m3_bits_to_fp16(bits):
    """float8_e4m3fn bits (uint8) -> float16 of value / 2^8, exactly: the sign to bit 15, the
    4 exponent and 3 mantissa bits to bits 13..7 (float16's bias 15 is e4m3's 7 + 8, and an
    e4m3 subnormal lands on a float16 subnormal). No NaN: quantised values are finite."""
    b = bits.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _block_step(a_rows, b_cols, as_rows, bs_ptr, acc, offs_m, offs_n, kb, M, N, K,
                stride_ak, stride_bk, stride_ask, stride_bsk,
                FP8_DOT: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + (a[:, Kb] @ b[Kb, :]) * a_scale[:, kb] * w_scale_inv[nb, kb] for K block `kb`:
    one dot per block from zero (fp8 MMA, or float16 MMA on tiles decoded from fp8 bits),
    promoted to the float32 accumulator with its scales."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + k[None, :] * stride_ak, mask=(offs_m[:, None] < M) & (k[None, :] < K),
                other=0.0)  # fmt: skip
    b = tl.load(b_cols + k[:, None] * stride_bk, mask=(k[:, None] < K) & (offs_n[None, :] < N),
                other=0.0)  # fmt: skip
    if FP8_DOT:
        part = tl.dot(a, b, out_dtype=tl.float32)
    else:  # uint8 bits decoded to float16 (values / 256 each: the product's 2^16 put back)
        part = tl.dot(_e4m3_bits_to_fp16(a), _e4m3_bits_to_fp16(b), out_dtype=tl.float32)
        part = part * 65536.0
    a_s = tl.load(as_rows + kb * stride_ask, mask=offs_m < M, other=0.0)
    b_s = tl.load(bs_ptr + kb * stride_bsk)
    return acc + part * (a_s[:, None] * b_s)


# M (the batch's tokens) and the K block count are plain arguments: one variant serves every
# batch, a one-token decode included (see layers/ops/__init__.py); so are the scale tensors'
# row strides (K / 128: 1, 4, 56, 112, ... in DeepSeek-V3), which would otherwise make a
# variant per specialisation class for loads too small to gain from it.
@triton.jit(do_not_specialize=["M", "num_k", "stride_asm", "stride_bsn"])
def _fp8_block_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, M, N, K, num_k,
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
    stride_om, stride_on,
    GROUP_N: tl.constexpr, FP8_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + offs_m[:, None] * stride_am
    b_cols = b_ptr + offs_n[None, :] * stride_bn
    as_rows = as_ptr + offs_m * stride_asm
    bs_row = bs_ptr + (n0 // GROUP_N) * stride_bsn  # BLOCK_N divides GROUP_N: one scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if WHILE_LOOP:  # the interpreter: its range() rejects a bound passed as an argument
        kb = 0
        while kb < num_k:
            acc = _block_step(a_rows, b_cols, as_rows, bs_row, acc, offs_m, offs_n, kb, M, N,
                              K, stride_ak, stride_bk, stride_ask, stride_bsk, FP8_DOT,
                              BLOCK_K)  # fmt: skip
            kb += 1
    else:  # a `for`, software-pipelined (Hopper's wgmma needs one, not a `while`)
        for kb in range(0, num_k):
            acc = _block_step(a_rows, b_cols, as_rows, bs_row, acc, offs_m, offs_n, kb, M, N,
                              K, stride_ak, stride_bk, stride_ask, stride_bsk, FP8_DOT,
                              BLOCK_K)  # fmt: skip
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit
def _round_to_e4m3(q):
    """float32 q (|q| <= 448) rounded to e4m3's grid, to nearest even, in float32: the
    spacing is 2^(exponent - 3), 2^-9 below e4m3's smallest normal 2^-6; adding and removing
    1.5 * 2^23 spacings leaves float32 that spacing, so its own rounding does it. (The cast
    after it is then exact: Triton 3.3's interpreter rounds float32 -> fp8 wrongly when the
    mantissa carries, 31.0 becoming 16.)"""
    bits = q.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    magic = spacing * 12582912.0  # 1.5 * 2^23: exact (a power of two times 3)
    rounded = (tl.abs(q) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)  # q's sign, a negative zero's included


# The activation's quantisation, one program per (row, 128-channel group); the row count is
# the grid's, so one variant per activation dtype and K class serves every batch (the
# scales' row stride, K / 128, unspecialised as in the GEMM).
@triton.jit(do_not_specialize=["stride_sm"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                            TINY: tl.constexpr):  # fmt: skip
    """`quant_matmul.quantize_fp8_groups` for one group: s = max(max|x|, TINY) / FP8_MAX,
    q = fp8(x / s), both divisions IEEE-rounded (`div_rn`) as torch's are, the rounding to
    e4m3 to nearest even as torch's cast is: the reference's bits."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), TINY), FP8_MAX)
    q = _round_to_e4m3(tl.math.div_rn(x, s))
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(s_ptr + row * stride_sm + g, s)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq fp8 [M, K], s float32 [M, ceil(K/group)]) in one launch, the bits of
    `quant_matmul.quantize_fp8_groups` (new tensors on x's device). Targets with fp8 (sm_89+
    and the interpreter); sm_80's Triton has no float8e4nv to store."""
    from srt_ascend.layers.ops import fp8_blocks as qm

    m, k = x.shape
    groups = triton.cdiv(k, group)
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, s
    _quantize_groups_kernel[(m, groups)](
        x, xq, s, k, x.stride(0), xq.stride(0), s.stride(0),
        GROUP=group, FP8_MAX=qm.FP8_MAX, TINY=qm.TINY,
    )  # fmt: skip
    return xq, s


def supports(block: tuple[int, int]) -> bool:
    """Whether the kernel serves weight blocks `block` (rows, columns): 128-wide K blocks (one
    scale per K step) and row blocks that BLOCK_N divides (one scale row per tile)."""
    bn, bk = block
    return bk == BLOCK_K and bn % BLOCK_N == 0


def fp8_dot() -> bool:
    """Whether the target has fp8 MMA (sm_89+; else the tiles are decoded to float16). The
    target is the active Triton driver's (`triton_offline` sets one). The interpreter runs
    the fp8 dot (its `tl.dot` converts e4m3 to float16, exactly, and sums in float32)."""
    if INTERPRETED:
        return True
    return triton.runtime.driver.active.get_current_target().arch >= FP8_MMA_CAPABILITY


def fp8_block_matmul(xq, x_scale, wq, scale_inv, group_n: int, out_dtype: torch.dtype,
                     fp8_mma: bool | None = None):  # fmt: skip
    """xq fp8 [M, K] (scales float32 [M, ceil(K/128)]) times wq fp8 [N, K]^T (scale_inv
    float32 [ceil(N/group_n), ceil(K/128)]) -> [M, N] in `out_dtype`, a new tensor on xq's
    device (module docstring's arithmetic). `fp8_mma`: force the dot's kind (tests); by
    default `fp8_dot()`."""
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    fp8 = fp8_dot() if fp8_mma is None else fp8_mma
    if not fp8:  # no float8e4nv before sm_89 in Triton: the kernel reads the bits
        xq, wq = xq.view(torch.uint8), wq.view(torch.uint8)
    _fp8_block_kernel[grid](
        xq, wq, x_scale, scale_inv, out, m, n, k, triton.cdiv(k, BLOCK_K),
        *xq.stride(), *wq.stride(), *x_scale.stride(), *scale_inv.stride(), *out.stride(),
        GROUP_N=group_n, FP8_DOT=fp8, WHILE_LOOP=INTERPRETED,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def fp8_block_linear(x, wq, scale_inv, block: tuple[int, int]):
    """Block FP8 linear, x [..., K] -> [..., N] in x's dtype: the activation quantised on the
    device (one Triton launch where the target stores fp8, else `quantize_fp8_groups`'s torch
    ops), then the fp8 GEMM; blocks the kernel does not serve (`supports`) take
    `quant_matmul`'s dequantising path."""
    from srt_ascend.layers.ops import fp8_blocks as qm

    if not supports(block):
        return qm.fp8_block_linear_dequant(x, wq, scale_inv, block)
    k = wq.shape[1]
    quantize = quantize_groups if fp8_dot() else qm.quantize_fp8_groups
    xq, s = quantize(x.reshape(-1, k), block[1])
    y = fp8_block_matmul(xq, s, wq, scale_inv, block[0], x.dtype)
    return y.view(*x.shape[:-1], wq.shape[0])
