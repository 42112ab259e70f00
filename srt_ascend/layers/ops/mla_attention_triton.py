"""Paged MLA attention in Triton: the kernel behind `mla_attention` on CUDA (contract there).

FlashMLA's schedule. All heads of MLA share one latent KV head, so one program holds a tile of
BLOCK_H query heads x BLOCK_Q query tokens of one request row (decode: a head block of one
token; verify: the 1+K tokens of a row share the tile where the head block leaves rows) and
walks that row's keys BLOCK_N at a time: each key tile is loaded once, over the full latent
width (rank 512) and the rope part (64) at once, and serves the scores of every row of the
tile and then, as MLA's value, their weighted sum. So a request's KV is read once per head
block (twice at DeepSeek-V3's 128 heads on Hopper), not once per head block per latent-column
block as before. The key loop is software-pipelined (`tl.range` with `num_stages` loads in
flight). An online softmax in float32 accumulates the [rows, rank] output in registers.

Lengths, query offsets and the row's slots in req_to_token are read on the device, so one
launch geometry (batch, max query length, number of KV parts) serves any KV length: a CUDA
graph captured per batch bucket replays for every step. Where the batch alone leaves the GPU
idle the KV is split into parts (flash-decoding) and a second kernel merges them by their
log-sum-exp. The tile, warps and stages are a per-geometry `plan` (cached).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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
    start, hi, m_i, l_i, acc, q_lat, q_pe, q_pos, row, r2t_ptr, ckv_ptr, kpe_ptr,
    STRIDE_R2T: tl.constexpr, STRIDE_CKV: tl.constexpr, STRIDE_KPE: tl.constexpr,
    RANK: tl.constexpr, ROPE: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    LOW_PRECISION_DOT: tl.constexpr,
):  # fmt: skip
    """One step of the key loop: keys start .. start + BLOCK_N (those below `hi`), loaded once
    at the full latent + rope width, folded into the online softmax (m_i, l_i) and the output
    accumulator `acc` of every tile row."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    slots = tl.load(r2t_ptr + row * STRIDE_R2T + offs_n, mask=n_valid, other=0).to(tl.int64)
    ckv = tl.load(
        ckv_ptr + slots[:, None] * STRIDE_CKV + offs_r[None, :],
        mask=n_valid[:, None] & (offs_r[None, :] < RANK),
        other=0.0,
    )
    kpe = tl.load(
        kpe_ptr + slots[:, None] * STRIDE_KPE + offs_p[None, :],
        mask=n_valid[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    )
    if not LOW_PRECISION_DOT:
        ckv = ckv.to(tl.float32)
        kpe = kpe.to(tl.float32)
    s = _dot(q_lat, tl.trans(ckv), LOW_PRECISION_DOT)
    s += _dot(q_pe, tl.trans(kpe), LOW_PRECISION_DOT)
    s = s * SCALE
    visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep zeros
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(ckv.dtype), ckv, LOW_PRECISION_DOT)
    return m_new, l_i, acc


# Arguments that follow each batch's lengths (the query blocks, the KV parts) are never
# specialised: Triton would compile a variant for the value 1 and another for multiples of
# 16, so they would pick kernel variants mid-request. What a server fixes (heads, latent and
# rope widths, the scale, the cache's and request table's row strides) is constexpr: fewer
# arguments for the host to bind per launch (Triton specialises each one), and masks and
# addresses known at compile time. The query and output strides follow the token count.
# Per-row scalars (lengths, rows, query starts) may be views at any offset of a larger tensor:
# their pointers' alignment is not specialised either (a scalar load gains nothing from it).
@triton.jit(
    do_not_specialize=["num_q_blocks", "num_splits"],
    do_not_specialize_on_alignment=["rows_ptr", "seq_lens_ptr", "q_lens_ptr", "q_starts_ptr"],
)
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, ckv_ptr, kpe_ptr, r2t_ptr, rows_ptr, seq_lens_ptr, q_lens_ptr,
    q_starts_ptr, out_ptr, lse_ptr,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh,
    num_q_blocks, num_splits,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, SCALE: tl.constexpr,
    STRIDE_CKV: tl.constexpr, STRIDE_KPE: tl.constexpr, STRIDE_R2T: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, SPLIT: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
    LOW_PRECISION_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    q_len = tl.load(q_lens_ptr + b)
    q_start = tl.load(q_starts_ptr + b)
    row = tl.load(rows_ptr + b)

    # Tile row m is query token q_block * BLOCK_Q + m // BLOCK_H, head m % BLOCK_H of the block.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    m_valid = (qi < q_len) & (head < NUM_HEADS)
    tok = q_start + qi
    q_pos = seq_len - q_len + qi  # query i sees keys 0 .. q_pos
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_lat = tl.load(
        q_lat_ptr + tok[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_r[None, :],
        mask=m_valid[:, None] & (offs_r[None, :] < RANK),
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + tok[:, None] * stride_qpt + head[:, None] * stride_qph + offs_p[None, :],
        mask=m_valid[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    )
    if not LOW_PRECISION_DOT:
        q_lat = q_lat.to(tl.float32)
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
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    if WHILE_LOOP:  # the interpreter: its range() rejects bounds read from the device
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_keys(
                start, hi, m_i, l_i, acc, q_lat, q_pe, q_pos, row, r2t_ptr, ckv_ptr, kpe_ptr,
                STRIDE_R2T, STRIDE_CKV, STRIDE_KPE, RANK, ROPE, SCALE,
                BLOCK_N, BLOCK_R, BLOCK_P, LOW_PRECISION_DOT,
            )  # fmt: skip
            start += BLOCK_N
    else:  # pipelined: NUM_STAGES key tiles in flight (a `while` is neither pipelined nor,
        # in Triton 3.3, able to hold Hopper's wgmma fences)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = _attend_keys(
                start, hi, m_i, l_i, acc, q_lat, q_pe, q_pos, row, r2t_ptr, ckv_ptr, kpe_ptr,
                STRIDE_R2T, STRIDE_CKV, STRIDE_KPE, RANK, ROPE, SCALE,
                BLOCK_N, BLOCK_R, BLOCK_P, LOW_PRECISION_DOT,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_r[None, :]
    out_mask = m_valid[:, None] & (offs_r[None, :] < RANK)
    if not SPLIT:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # parts [T, H, splits, RANK] (out's strides) and their lse [T, H, splits]
        tl.store(out_ptrs + split * RANK, out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lse_at = (tok.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(lse_ptr + lse_at, lse, mask=m_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    # out = sum_s exp(lse_s - max lse) * part_s / sum_s exp(lse_s - max lse); zeros if no key.
    # Both sums run over the parts one by one in key order (a tree sum's shape would follow
    # the number of parts, i.e. the batch's longest KV; parts a query does not reach add exact
    # zeros), so the result depends on the query's own parts alone, and the number of parts
    # is a plain argument: one compiled variant serves every split count.
    # parts: contiguous [T, H, num_splits, RANK] float32; lse: [T, H, num_splits]
    t = tl.program_id(0) // NUM_HEADS
    h = tl.program_id(0) % NUM_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    row_at = t.to(tl.int64) * NUM_HEADS + h
    lse_row = lse_ptr + row_at * num_splits + tl.zeros([1], tl.int32)
    top = tl.full([1], float("-inf"), tl.float32)
    s = 0
    while s < num_splits:
        top = tl.maximum(top, tl.load(lse_row + s))
        s += 1
    shift = tl.where(top == float("-inf"), 0.0, top)
    head_parts = part_ptr + row_at * num_splits * RANK
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    s = 0
    while s < num_splits:
        w_s = tl.exp(tl.load(lse_row + s) - shift)
        part = tl.load(head_parts + s * RANK + offs_r, mask=offs_r < RANK, other=0.0)
        total += w_s
        acc += part * w_s
        s += 1
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_r,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_r < RANK,
    )


@dataclass(frozen=True)
class Tile:
    """A program's tile: `rows` query rows (heads x tokens) against `keys` keys per step, the
    key loop's `stages` loads in flight, `warps` per program."""

    rows: int
    keys: int
    stages: int
    warps: int


# Tiles at DeepSeek-V3's shapes (latent 512 + rope 64), chosen by compiling them for sm_90 and
# sm_80 with Triton 3.3 (`python -m srt_ascend.layers.ops.triton_offline`; the budgets are held
# by tests/unit/test_triton_compile.py). The query tile [rows, 576] sits in shared memory for
# the whole loop; the key tile [keys, 576] is copied asynchronously into `stages - 1` buffers
# and serves both dots (scores, then the weighted sum); the [rows, 512] float32 accumulator
# stays in registers (rows x 512 / (32 x warps) per thread).
# - Hopper, bf16/fp16: 64 rows (one wgmma M) x 32 keys, 3 stages, 8 warps: 148 KiB of shared
#   memory (query 72 KiB, two key buffers 72 KiB), ~240 registers, no spills.
# - Other GPUs, bf16/fp16: 32 x 16, 2 stages, 8 warps: 55 KiB (fits sm_86/89's 99 KiB), ~240
#   registers, no spills (4 warps spill 160 bytes).
# - float32 (IEEE dots on the FMA units, 4-byte operands): 16 x 16, 2 stages, 4 warps: 73 KiB,
#   ~200 registers, no spills.
# One stage (no pipelining) spills on both bf16 tiles.
HOPPER_HALF_TILE = Tile(rows=64, keys=32, stages=3, warps=8)
HALF_TILE = Tile(rows=32, keys=16, stages=2, warps=8)
FLOAT_TILE = Tile(rows=16, keys=16, stages=2, warps=4)
TILE_ROWS = (FLOAT_TILE.rows, HALF_TILE.rows, HOPPER_HALF_TILE.rows)


def pick_tile(half: bool, capability: int) -> Tile:
    """The tile for bf16/fp16 (`half`) or float32 caches on CUDA `capability` (90 = sm_90; 0:
    the interpreter, which gets the tiles of sm_80)."""
    if not half:
        return FLOAT_TILE
    return HOPPER_HALF_TILE if capability >= 90 else HALF_TILE


@dataclass(frozen=True)
class Plan:
    """One launch's geometry: the tile's query tokens x heads, keys per step, stages, warps."""

    block_q: int
    block_h: int
    block_n: int
    num_stages: int
    num_warps: int


def tile_shape(
    num_heads: int, max_q_len: int, fixed: bool = False, rows: int = 64
) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H) of a `rows`-row tile: up to `rows` heads of one token, the rest of
    the rows for further tokens of the same request row, at least 16 rows (a dot's minimum;
    spare rows are masked). `fixed` (batch-invariant): the tallest tile whatever the query
    length, so every forward's dots have one shape."""
    block_h = min(triton.next_power_of_2(num_heads), rows)
    block_q = max(1, rows // block_h)
    if not fixed:
        block_q = min(triton.next_power_of_2(max(max_q_len, 1)), block_q)
    return max(block_q, 16 // block_h), block_h


@functools.lru_cache(maxsize=1024)
def plan(num_heads: int, max_q_len: int, half: bool, capability: int, fixed: bool) -> Plan:
    """The launch geometry for one forward's attention (cached: host values only, computed once
    per geometry, not per layer)."""
    tile = pick_tile(half, capability)
    block_q, block_h = tile_shape(num_heads, max_q_len, fixed, tile.rows)
    return Plan(block_q, block_h, tile.keys, tile.stages, tile.warps)


def capability(device: torch.device) -> int:
    """The CUDA capability kernels on `device` compile for (90 for sm_90): the device's own;
    for CPU tensors the active Triton driver's target (`triton_offline.compiling_for`); 0
    under the interpreter."""
    if INTERPRETED:
        return 0
    if device.type == "cuda":
        from srt_ascend.platforms.cuda import cuda_capability

        return cuda_capability(device.index if device.index is not None else 0)
    return triton.runtime.driver.active.get_current_target().arch


def launch_plan(q_latent: torch.Tensor, max_q_len: int, fixed: bool = False) -> Plan:
    """`plan` for a forward whose queries are `q_latent` [T, H, R] (dtype, device, heads)."""
    half = q_latent.dtype in (torch.bfloat16, torch.float16)
    return plan(q_latent.shape[1], max_q_len, half, capability(q_latent.device), fixed)


def q_len_buckets(num_heads: int, fixed: bool = False) -> list[int]:
    """One query length per tile height (`tile_shape`'s BLOCK_Q) a launch can choose, over
    every tile any GPU and dtype uses: 1, 2, 4, ... up to the tallest tile. With the query
    blocks and KV parts plain arguments, a launch's variant is its BLOCK_Q, whether it splits
    the KV, and the model's dtypes and shapes: these lengths, each over one KV part and over
    several, launch every variant."""
    lengths = set()
    for rows in TILE_ROWS:
        tallest = tile_shape(num_heads, 1 << 30, fixed, rows)[0]
        seen: set[int] = set()
        q = 1
        while True:
            block_q = tile_shape(num_heads, q, fixed, rows)[0]
            if block_q not in seen:
                seen.add(block_q)
                lengths.add(q)
            if block_q == tallest:
                break
            q *= 2
    return sorted(lengths)


# --enable-deterministic-inference: keys per KV part (a multiple of every tile's keys). Parts
# sit at fixed key positions, so long KV still spreads over programs (flash-decoding) while
# each query's reduction order follows its own length alone.
INVARIANT_KV_SPLIT = 256


def invariant_kv_splits(max_kv_len: int, size: int = INVARIANT_KV_SPLIT) -> int:
    """How many fixed-size parts cover `max_kv_len` keys (at least one)."""
    return max(1, triton.cdiv(max_kv_len, size))


# Compiled attention kernels launched in this process, by their (cached) launch constants'
# identity (filled on a GPU; the interpreter compiles nothing): what `compiled_resources`
# reports.
_COMPILED: dict[int, tuple[dict, object]] = {}
SHARED_MEMORY_BUDGET = 232448  # sm_90's per-block limit; tests hold each tile to its GPU's


def compiled_resources() -> list[dict]:
    """Per compiled attention kernel: its launch constants, shared memory (bytes), registers
    and spilled registers per thread (empty under the interpreter)."""
    rows = []
    for consts, kernel in _COMPILED.values():
        meta = getattr(kernel, "metadata", None)
        rows.append({
            "tile": dict(consts),
            "shared_bytes": getattr(meta, "shared", None),
            "registers": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
        })  # fmt: skip
    return rows


@functools.lru_cache(maxsize=256)
def _constants(
    pl: Plan, heads: int, rank: int, rope: int, scale: float, stride_ckv: int, stride_kpe: int,
    stride_r2t: int, split: bool, split_size: int, low_precision: bool,
) -> dict:  # fmt: skip
    """The attention kernel's launch constants (one dict per variant, cached: shared by every
    launch of the variant and never modified)."""
    return dict(
        NUM_HEADS=heads, RANK=rank, ROPE=rope, SCALE=scale, STRIDE_CKV=stride_ckv,
        STRIDE_KPE=stride_kpe, STRIDE_R2T=stride_r2t, BLOCK_Q=pl.block_q, BLOCK_H=pl.block_h,
        BLOCK_N=pl.block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), SPLIT=split, SPLIT_SIZE=split_size,
        NUM_STAGES=pl.num_stages, LOW_PRECISION_DOT=low_precision, WHILE_LOOP=INTERPRETED,
    )  # fmt: skip


def mla_attention(
    q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
    scale: float, *, max_q_len: int, num_kv_splits: int = 1, out: torch.Tensor | None = None,
    kv_split_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launches the kernel (see `mla_attention.mla_attention_reference` for the contract).

    Only host values decide the launch: the batch size, `max_q_len` and `num_kv_splits`;
    nothing is read back from the device, so the call can be captured in a CUDA graph.
    float32 caches compute true float32 dots (`input_precision="ieee"`), not TF32.

    `kv_split_size` (batch-invariant mode, `--enable-deterministic-inference`): part s holds
    keys [s * size, (s + 1) * size) whatever the lengths, the tile is the fixed tallest one,
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
    pl = launch_plan(q_latent, max_q_len, fixed=kv_split_size is not None)
    if kv_split_size is not None and kv_split_size % pl.block_n:
        raise ValueError(f"kv_split_size must be a multiple of {pl.block_n}: {kv_split_size}")
    num_q_blocks = triton.cdiv(max(max_q_len, 1), pl.block_q)
    splits = max(1, num_kv_splits)
    # bf16/fp16 caches: tensor-core dots with float32 accumulation (probabilities rounded to
    # the cache dtype for the second one, as flash attention does). The interpreter computes
    # half-precision dots wrongly (Triton 3.3), so there the same tiles go through float32.
    low_precision = c_kv.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED
    if splits == 1:
        target = lse = out
    else:
        target = torch.empty(t, h, splits, rank, dtype=torch.float32, device=out.device)
        lse = torch.empty(t, h, splits, dtype=torch.float32, device=out.device)
    consts = _constants(
        pl, h, rank, rope, scale, c_kv.stride(0), k_pe.stride(0), req_to_token.stride(0),
        splits > 1, kv_split_size or 0, low_precision,
    )  # fmt: skip
    sq, sp, so = q_latent.stride(), q_pe.stride(), target.stride()
    kernel = _mla_attention_kernel[(batch * num_q_blocks, triton.cdiv(h, pl.block_h), splits)](
        q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
        target, lse, sq[0], sq[1], sp[0], sp[1], so[0], so[1], num_q_blocks, splits,
        **consts, num_stages=pl.num_stages, num_warps=pl.num_warps,
    )  # fmt: skip
    if kernel is not None and not INTERPRETED:
        _COMPILED.setdefault(id(consts), (consts, kernel))
    if splits > 1:
        _merge_splits_kernel[(t * h,)](
            target, lse, out, splits, out.stride(0), out.stride(1),
            NUM_HEADS=h, RANK=rank, BLOCK_R=consts["BLOCK_R"],
        )  # fmt: skip
    return out
