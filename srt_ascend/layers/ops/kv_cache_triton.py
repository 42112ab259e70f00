"""Triton kernels for `kv_cache` (contracts there): the KV store and req_to_token assignment.

Both read every index and length on the device, so they can be captured in a CUDA graph.
Index arguments are often views at a batch-dependent offset of one host-to-device copy
(`ReqToTokenPool.write`): their pointers' alignment is not specialised, so a batch's size
never picks a kernel variant."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["loc_ptr"])
def _store_kv_kernel(
    ckv_buf_ptr, kpe_buf_ptr, loc_ptr, ckv_ptr, kpe_ptr,
    stride_cb, stride_kb, stride_c, stride_k, rank, rope_dim,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    slot = tl.load(loc_ptr + i).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    c = tl.load(ckv_ptr + i * stride_c + offs_r, mask=offs_r < rank)
    tl.store(
        ckv_buf_ptr + slot * stride_cb + offs_r,
        c.to(ckv_buf_ptr.dtype.element_ty),
        mask=offs_r < rank,
    )
    k = tl.load(kpe_ptr + i * stride_k + offs_p, mask=offs_p < rope_dim)
    tl.store(
        kpe_buf_ptr + slot * stride_kb + offs_p,
        k.to(kpe_buf_ptr.dtype.element_ty),
        mask=offs_p < rope_dim,
    )


def store_kv(c_kv_buf, k_pe_buf, loc, c_kv, k_pe) -> None:
    n = loc.shape[0]
    if n == 0:
        return
    # Cast in torch (a no-op for the model's own dtype): round-to-nearest-even everywhere,
    # where the interpreter's in-kernel float32 -> bf16 conversion truncates.
    c_kv = c_kv.reshape(n, -1).to(c_kv_buf.dtype)
    k_pe = k_pe.reshape(n, -1).to(k_pe_buf.dtype)
    rank, rope = c_kv.shape[1], k_pe.shape[1]
    if c_kv.stride(1) != 1 or k_pe.stride(1) != 1 or c_kv_buf.stride(-1) != 1:
        raise ValueError("store_kv needs rows contiguous in their last dimension")
    _store_kv_kernel[(n,)](
        c_kv_buf, k_pe_buf, loc, c_kv, k_pe,
        c_kv_buf.stride(0), k_pe_buf.stride(0), c_kv.stride(0), k_pe.stride(0), rank, rope,
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
    )  # fmt: skip


@triton.jit(
    do_not_specialize_on_alignment=["rows_ptr", "starts_ptr", "ends_ptr", "offsets_ptr", "loc_ptr"]
)
def _assign_kernel(
    r2t_ptr, rows_ptr, starts_ptr, ends_ptr, offsets_ptr, loc_ptr, stride_r2t,
    BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b)
    end = tl.load(ends_ptr + b)
    offset = tl.load(offsets_ptr + b)
    pos = start
    while pos < end:
        offs = pos + tl.arange(0, BLOCK)
        mask = offs < end
        slots = tl.load(loc_ptr + offset + (offs - start), mask=mask)
        tl.store(r2t_ptr + row * stride_r2t + offs, slots.to(r2t_ptr.dtype.element_ty), mask=mask)
        pos += BLOCK


def assign_req_to_token(req_to_token, req_pool_indices, starts, ends, out_cache_loc) -> None:
    batch = req_pool_indices.shape[0]
    if batch == 0:
        return
    counts = ends - starts
    offsets = torch.cumsum(counts, 0) - counts  # on the device: no host read
    _assign_kernel[(batch,)](
        req_to_token, req_pool_indices, starts, ends, offsets, out_cache_loc,
        req_to_token.stride(0), BLOCK=128,
    )  # fmt: skip
