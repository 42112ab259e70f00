"""Paged MLA attention in Triton: the kernel behind `mla_attention` on CUDA (contract there).

One program computes a tile of BLOCK_Q query tokens x BLOCK_H heads (all heads share MLA's one
latent KV head, so a tile reads each key once for BLOCK_H heads) over one part of its row's KV
(split-KV / flash-decoding), with an online softmax in float32. Lengths, query offsets and the
row's slots in req_to_token are read on the device, so one launch geometry (batch, max query
length, number of KV parts) serves any KV length: a CUDA graph captured per batch bucket
replays for every step, and each part walks only the keys its row really has. With more than
one part, a second kernel merges the parts by their log-sum-exp.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# TRITON_INTERPRET is read by `triton.jit` when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, LOW_PRECISION_DOT: tl.constexpr):
    """a @ b accumulated in float32: tensor-core dots for bf16/fp16 operands, true float32
    products for float32 ones (Triton's default for float32 is TF32, 10 mantissa bits)."""
    if LOW_PRECISION_DOT:
        return tl.dot(a, b)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_keys(
    start, hi, m_i, l_i, acc, q_pe, q_lat_rows, m_valid, q_pos, row, r2t_ptr, ckv_ptr, kpe_ptr,
    stride_r2t, stride_ckv, stride_kpe, rank, rope_dim, scale,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, dv, LOW_PRECISION_DOT: tl.constexpr,
):  # fmt: skip
    """One step of the key loop: keys start .. start + BLOCK_N (those below `hi`) folded into
    the online softmax (m_i, l_i) and the output accumulator `acc`."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    slots = tl.load(r2t_ptr + row * stride_r2t + offs_n, mask=n_valid, other=0).to(tl.int64)
    kpe = tl.load(
        kpe_ptr + slots[:, None] * stride_kpe + offs_p[None, :],
        mask=n_valid[:, None] & (offs_p[None, :] < rope_dim),
        other=0.0,
    )
    if not LOW_PRECISION_DOT:
        kpe = kpe.to(tl.float32)
    s = _dot(q_pe, tl.trans(kpe), LOW_PRECISION_DOT)
    # The latent part of the scores, BLOCK_K columns at a time (the query chunk is
    # reloaded from L1/L2: a whole [rows, rank] query tile would not fit in registers).
    for kk in tl.static_range(NUM_K):
        cols = kk * BLOCK_K + offs_k
        q_lat = tl.load(
            q_lat_rows + cols[None, :],
            mask=m_valid[:, None] & (cols[None, :] < rank),
            other=0.0,
        )
        ckv = tl.load(
            ckv_ptr + slots[:, None] * stride_ckv + cols[None, :],
            mask=n_valid[:, None] & (cols[None, :] < rank),
            other=0.0,
        )
        if not LOW_PRECISION_DOT:
            q_lat = q_lat.to(tl.float32)
            ckv = ckv.to(tl.float32)
        s += _dot(q_lat, tl.trans(ckv), LOW_PRECISION_DOT)
    s = s * scale
    visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep zeros
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        ckv_ptr + slots[:, None] * stride_ckv + offs_v[None, :],
        mask=n_valid[:, None] & (offs_v[None, :] < rank),
        other=0.0,
    )
    if LOW_PRECISION_DOT:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, LOW_PRECISION_DOT)
    else:
        acc = acc * alpha[:, None] + _dot(p, v.to(tl.float32), LOW_PRECISION_DOT)
    return m_new, l_i, acc


# Arguments that follow each batch's lengths (the query blocks, the KV parts and the strides
# of the per-part log-sum-exp) are never specialised: Triton would compile a variant for the
# value 1 and another for multiples of 16, so they would pick kernel variants mid-request.
# Per-row scalars (lengths, rows, query starts) may be views at any offset of a larger tensor:
# their pointers' alignment is not specialised either (a scalar load gains nothing from it).
@triton.jit(
    do_not_specialize=["num_q_blocks", "num_splits", "stride_lt", "stride_lh"],
    do_not_specialize_on_alignment=["rows_ptr", "seq_lens_ptr", "q_lens_ptr", "q_starts_ptr"],
)
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, ckv_ptr, kpe_ptr, r2t_ptr, rows_ptr, seq_lens_ptr, q_lens_ptr,
    q_starts_ptr, out_ptr, lse_ptr, scale,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ckv, stride_kpe, stride_r2t,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    num_heads, rank, rope_dim, num_q_blocks, num_splits,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
    BLOCK_P: tl.constexpr, SPLIT: tl.constexpr, SPLIT_SIZE: tl.constexpr,
    LOW_PRECISION_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    split = tl.program_id(2) // NUM_DV
    dv = tl.program_id(2) % NUM_DV  # this program's BLOCK_DV columns of the output latent
    seq_len = tl.load(seq_lens_ptr + b)
    q_len = tl.load(q_lens_ptr + b)
    q_start = tl.load(q_starts_ptr + b)
    row = tl.load(rows_ptr + b)

    # Tile row m is query token q_block * BLOCK_Q + m // BLOCK_H, head m % BLOCK_H of the block.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    m_valid = (qi < q_len) & (head < num_heads)
    tok = q_start + qi
    q_pos = seq_len - q_len + qi  # query i sees keys 0 .. q_pos
    offs_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_p = tl.arange(0, BLOCK_P)
    q_lat_rows = q_lat_ptr + tok[:, None] * stride_qlt + head[:, None] * stride_qlh
    q_pe = tl.load(
        q_pe_ptr + tok[:, None] * stride_qpt + head[:, None] * stride_qph + offs_p[None, :],
        mask=m_valid[:, None] & (offs_p[None, :] < rope_dim),
        other=0.0,
    )
    if not LOW_PRECISION_DOT:
        q_pe = q_pe.to(tl.float32)

    # This part's keys: [lo, hi), cut at the last position any query of the tile can see.
    # SPLIT_SIZE > 0 (batch-invariant): parts at fixed key positions, whatever the lengths.
    if SPLIT_SIZE > 0:
        part = SPLIT_SIZE
    else:
        part = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * part
    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    hi = tl.minimum(tl.minimum(lo + part, seq_len), seq_len - q_len + last_q + 1)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_DV], tl.float32)
    if WHILE_LOOP:  # the interpreter: its range() rejects bounds read from the device
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_keys(
                start, hi, m_i, l_i, acc, q_pe, q_lat_rows, m_valid, q_pos, row, r2t_ptr,
                ckv_ptr, kpe_ptr, stride_r2t, stride_ckv, stride_kpe, rank, rope_dim, scale,
                BLOCK_N, BLOCK_K, NUM_K, BLOCK_DV, BLOCK_P, dv, LOW_PRECISION_DOT,
            )  # fmt: skip
            start += BLOCK_N
    else:  # a `for`: Triton 3.3 cannot place Hopper's wgmma fences inside a `while`
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                start, hi, m_i, l_i, acc, q_pe, q_lat_rows, m_valid, q_pos, row, r2t_ptr,
                ckv_ptr, kpe_ptr, stride_r2t, stride_ckv, stride_kpe, rank, rope_dim, scale,
                BLOCK_N, BLOCK_K, NUM_K, BLOCK_DV, BLOCK_P, dv, LOW_PRECISION_DOT,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_v[None, :]
    out_mask = m_valid[:, None] & (offs_v[None, :] < rank)
    if not SPLIT:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + split * stride_os, out, mask=out_mask)
        if dv == 0:  # every latent block of a part computes the same log-sum-exp
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=m_valid)


@triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, rank, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    # out = sum_s exp(lse_s - max lse) * part_s / sum_s exp(lse_s - max lse); zeros if no key.
    # Both sums run over the parts one by one in key order (a tree sum's shape would follow
    # the number of parts, i.e. the batch's longest KV; parts a query does not reach add exact
    # zeros), so the result depends on the query's own parts alone, and the number of parts
    # is a plain argument: one compiled variant serves every split count.
    t = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    offs_r = tl.arange(0, BLOCK_R)
    lse_row = lse_ptr + t * stride_lt + h * stride_lh + tl.zeros([1], tl.int32)
    top = tl.full([1], float("-inf"), tl.float32)
    s = 0
    while s < num_splits:
        top = tl.maximum(top, tl.load(lse_row + s))
        s += 1
    shift = tl.where(top == float("-inf"), 0.0, top)
    head_parts = part_ptr + t * stride_pt + h * stride_ph
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    s = 0
    while s < num_splits:
        w_s = tl.exp(tl.load(lse_row + s) - shift)
        part = tl.load(head_parts + s * stride_ps + offs_r, mask=offs_r < rank, other=0.0)
        total += w_s
        acc += part * w_s
        s += 1
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_r,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_r < rank,
    )


# Tiles of the attention kernel, sized for <= 100 KiB of shared memory (GPUs with the least,
# sm86/sm89, give a block 99 KiB) and no register spills at DeepSeek-V3's shapes (rank 512,
# rope 64), float32 caches being the worst case (4-byte operands). A program owns a tile of at
# most 64 rows (tile_shape), BLOCK_N = 32 keys per step, the scores' latent contraction in
# BLOCK_K = 64 columns, and BLOCK_DV = 128 of the output's latent columns (the grid's third
# axis runs NUM_DV = rank / 128 programs per KV part; each recomputes the scores). Dot operands
# staged in shared memory per key step: q_pe [64, 64] 16 KiB + k_pe [32, 64] 8 KiB; a q_lat
# chunk [64, 64] 16 KiB + a c_kv chunk [32, 64] 8 KiB; p [64, 32] 8 KiB + v [32, 128] 16 KiB:
# 72 KiB were all of them live at once (Triton reuses buffers whose lifetimes do not overlap,
# and the `while` loop is not pipelined, so no stage is doubled); bf16 halves it. Registers
# per thread (4 warps): acc [64, 128] fp32 64, q_pe 32, scores and p 16 each: ~140 of 255.
# The former tile (the whole 512-wide latent per program) needed 128 KiB for q_lat alone and
# 256 registers per thread for the accumulator. benchmark/device_check.py reports the
# compiled kernels' shared memory, registers and spills (`compiled_resources`).
BLOCK_N = 32
BLOCK_K = 64
BLOCK_DV = 128
# The key loop is a `for`, which Triton software-pipelines with `num_stages` copies of its
# loads in shared memory (3 by default: 241 KiB at float32, over every GPU's limit). One stage:
# the budget above, as the former `while` loop had (pipelining it is issue 43's new kernel).
NUM_STAGES = 1
# Warps per program: float32 tiles (IEEE dots on the FMA units, 4-byte operands) spread over
# 8 warps: at DeepSeek-V3's shapes ptxas (Triton 3.3, sm_90) then leaves 8 / 0 / 1192 bytes
# of stack per thread for 16 / 32 / 64-row tiles instead of 32 / 240 / 7984 at 4 warps
# (`python -m srt_ascend.layers.ops.triton_offline`); bf16 tiles keep 4 warps and spill
# nothing on sm_90. (The 64-row float32 tile still spills: issue 43's new kernel.)
NUM_WARPS = {True: 4, False: 8}  # by LOW_PRECISION_DOT
SHARED_MEMORY_BUDGET = 100 * 1024

# Compiled attention kernels launched in this process, by launch constants (filled on a GPU;
# the interpreter compiles nothing): what `compiled_resources` reports.
_COMPILED: dict[tuple, object] = {}


def tile_shape(num_heads: int, max_q_len: int, fixed: bool = False) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H): up to 16 heads per tile, up to 64 tile rows, at least 16 (a dot's
    minimum) - spare rows are masked. `fixed` (batch-invariant): the largest tile whatever
    the query length, so every forward's dots have one shape."""
    block_h = min(triton.next_power_of_2(num_heads), 16)
    block_q = max(1, 64 // block_h)
    if not fixed:
        block_q = min(triton.next_power_of_2(max(max_q_len, 1)), block_q)
    return max(block_q, 16 // block_h), block_h


def q_len_buckets(num_heads: int, fixed: bool = False) -> list[int]:
    """One query length per tile height (`tile_shape`'s BLOCK_Q) a launch can choose: 1, 2,
    4, ... up to the tallest tile. With the query blocks and KV parts plain arguments, a
    launch's variant is its BLOCK_Q, whether it splits the KV, and the model's dtypes and
    shapes: these lengths, each over one KV part and over several, launch every variant."""
    tallest = tile_shape(num_heads, 1 << 30, fixed)[0]
    by_tile: dict[int, int] = {}
    q = 1
    while True:
        block_q = tile_shape(num_heads, q, fixed)[0]
        by_tile.setdefault(block_q, q)
        if block_q == tallest:
            return list(by_tile.values())
        q *= 2


def latent_tiles(rank: int, block_k: int = BLOCK_K, block_dv: int = BLOCK_DV):
    """(BLOCK_K, NUM_K, BLOCK_DV, NUM_DV): the latent's chunks for the scores and for the
    output, each at least 16 wide (a dot's minimum) and at most the padded rank."""
    padded = max(16, triton.next_power_of_2(rank))
    bk, bdv = min(block_k, padded), min(block_dv, padded)
    return bk, padded // bk, bdv, padded // bdv


# --enable-deterministic-inference: keys per KV part (a multiple of BLOCK_N). Parts sit at
# fixed key positions, so long KV still spreads over programs (flash-decoding) while each
# query's reduction order follows its own length alone.
INVARIANT_KV_SPLIT = 256


def invariant_kv_splits(max_kv_len: int, size: int = INVARIANT_KV_SPLIT) -> int:
    """How many fixed-size parts cover `max_kv_len` keys (at least one)."""
    return max(1, triton.cdiv(max_kv_len, size))


def compiled_resources() -> list[dict]:
    """Per compiled attention kernel: its launch constants, shared memory (bytes), registers
    and spilled registers per thread (empty under the interpreter)."""
    rows = []
    for key, kernel in _COMPILED.items():
        meta = getattr(kernel, "metadata", None)
        rows.append({
            "tile": dict(key),
            "shared_bytes": getattr(meta, "shared", None),
            "registers": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
        })  # fmt: skip
    return rows


def mla_attention(
    q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
    scale: float, *, max_q_len: int, num_kv_splits: int = 1, out: torch.Tensor | None = None,
    block_k: int = BLOCK_K, block_dv: int = BLOCK_DV, kv_split_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launches the kernel (see `mla_attention.mla_attention_reference` for the contract).

    Only host values decide the launch: the batch size, `max_q_len` and `num_kv_splits`;
    nothing is read back from the device, so the call can be captured in a CUDA graph.
    `block_k` / `block_dv` override the latent tiles (tests run several chunks at small
    ranks). float32 caches compute true float32 dots (`input_precision="ieee"`), not TF32.

    `kv_split_size` (batch-invariant mode, `--enable-deterministic-inference`): part s holds
    keys [s * size, (s + 1) * size) whatever the lengths, the tile is the fixed largest one,
    and the parts merge one by one in key order. A query's result is then a function of its
    own query and keys alone - not of the batch, the other queries of its row, or the number
    of parts, which must cover the longest KV (`invariant_kv_splits`)."""
    t, h, rank = q_latent.shape
    rope = q_pe.shape[-1]
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q_latent)
    if t == 0 or batch == 0:
        return out
    for name, x in (("q_latent", q_latent), ("q_pe", q_pe), ("c_kv", c_kv), ("k_pe", k_pe)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if kv_split_size is not None and kv_split_size % BLOCK_N:
        raise ValueError(f"kv_split_size must be a multiple of {BLOCK_N}, got {kv_split_size}")
    block_q, block_h = tile_shape(h, max_q_len, fixed=kv_split_size is not None)
    bk, num_k, bdv, num_dv = latent_tiles(rank, block_k, block_dv)
    num_q_blocks = triton.cdiv(max(max_q_len, 1), block_q)
    splits = max(1, num_kv_splits)
    # bf16/fp16 caches: tensor-core dots with float32 accumulation (probabilities rounded to
    # the cache dtype for the second one, as flash attention does). The interpreter computes
    # half-precision dots wrongly (Triton 3.3), so there the same tiles go through float32.
    low_precision = c_kv.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    if splits == 1:
        target, lse, so, sl = out, out, 0, (0, 0)
    else:
        target = torch.empty(t, h, splits, rank, dtype=torch.float32, device=out.device)
        lse = torch.empty(t, h, splits, dtype=torch.float32, device=out.device)
        so, sl = target.stride(2), (lse.stride(0), lse.stride(1))
    grid = (batch * num_q_blocks, triton.cdiv(h, block_h), splits * num_dv)
    consts = dict(
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_K=bk, NUM_K=num_k,
        BLOCK_DV=bdv, NUM_DV=num_dv, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        SPLIT=splits > 1, SPLIT_SIZE=kv_split_size or 0,
        LOW_PRECISION_DOT=low_precision, WHILE_LOOP=INTERPRETED,
    )  # fmt: skip
    kernel = _mla_attention_kernel[grid](
        q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
        target, lse, scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_kv.stride(0), k_pe.stride(0), req_to_token.stride(0),
        target.stride(0), target.stride(1), so, sl[0], sl[1],
        h, rank, rope, num_q_blocks, splits, **consts,
        num_stages=NUM_STAGES, num_warps=NUM_WARPS[low_precision],
    )  # fmt: skip
    if kernel is not None and not INTERPRETED:
        _COMPILED.setdefault(tuple(sorted(consts.items())), kernel)
    if splits > 1:
        _merge_splits_kernel[(t * h,)](
            target, lse, out, h, rank, splits,
            target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), BLOCK_R=max(16, triton.next_power_of_2(rank)),
        )  # fmt: skip
    return out
