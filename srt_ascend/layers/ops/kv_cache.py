"""KV bookkeeping ops: writing new tokens' latents into the cache, and slot assignment.

`store_kv`: c_kv_buf[loc[i], 0] = c_kv[i], k_pe_buf[loc[i], 0] = k_pe[i] for every new token i,
cast to the cache dtype. The two buffers are separate tensors with their own strides (views of
one interleaved buffer, or two buffers). Duplicate slots in `loc` (padding rows all pointing at
slot 0) are allowed; which write wins among them is unspecified.

`assign_req_to_token`: row r of a batch gets the slots for its positions [starts[r], ends[r]):
req_to_token[req_pool_indices[r], starts[r] + j] = out_cache_loc[offset_r + j], where offset_r
is the sum of ends - starts over the rows before r (out_cache_loc is packed row after row).
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops import pick, triton_available


def store_kv_reference(
    c_kv_buf: torch.Tensor,  # [slots, 1, R]
    k_pe_buf: torch.Tensor,  # [slots, 1, P]
    loc: torch.Tensor,  # [N] slot of each new token
    c_kv: torch.Tensor,  # [N, R] (or [N, 1, R])
    k_pe: torch.Tensor,  # [N, P] (or [N, 1, P])
) -> None:
    n = loc.shape[0]
    loc = loc.to(torch.int64)
    c_kv_buf[loc, 0] = c_kv.reshape(n, -1).to(c_kv_buf.dtype)
    k_pe_buf[loc, 0] = k_pe.reshape(n, -1).to(k_pe_buf.dtype)


def assign_req_to_token_reference(
    req_to_token: torch.Tensor,  # [rows, max_context]
    req_pool_indices: torch.Tensor,  # [B]
    starts: torch.Tensor,  # [B] first position to assign
    ends: torch.Tensor,  # [B] one past the last position
    out_cache_loc: torch.Tensor,  # [sum(ends - starts)] slots, packed row after row
) -> None:
    # One scatter; the token count is the slots' length, so no length is read on the host.
    n = out_cache_loc.shape[0]
    counts = ends - starts
    owner = torch.repeat_interleave(  # [n] batch row of each slot
        torch.arange(counts.shape[0], device=counts.device), counts, output_size=n
    )
    offsets = torch.cumsum(counts, 0) - counts
    cols = starts[owner] + torch.arange(n, device=counts.device) - offsets[owner]
    req_to_token[req_pool_indices[owner], cols] = out_cache_loc.to(req_to_token.dtype)


def _load_store_kv():
    from srt_ascend.layers.ops import kv_cache_triton

    return kv_cache_triton.store_kv


def _load_assign():
    from srt_ascend.layers.ops import kv_cache_triton

    return kv_cache_triton.assign_req_to_token


# device type -> loader; NPU uses Triton-Ascend when it is installed (torch_npu has no fused op)
_STORE_IMPLS = {"cuda": _load_store_kv}
_ASSIGN_IMPLS = {"cuda": _load_assign}
if triton_available():
    _STORE_IMPLS["npu"] = _load_store_kv
    _ASSIGN_IMPLS["npu"] = _load_assign


def store_kv(c_kv_buf, k_pe_buf, loc, c_kv, k_pe) -> None:
    """Dispatches by the cache's device (see the module docstring for the contract)."""
    pick(_STORE_IMPLS, c_kv_buf.device, store_kv_reference)(c_kv_buf, k_pe_buf, loc, c_kv, k_pe)


def assign_req_to_token(req_to_token, req_pool_indices, starts, ends, out_cache_loc) -> None:
    """Dispatches by req_to_token's device (see the module docstring for the contract)."""
    fn = pick(_ASSIGN_IMPLS, req_to_token.device, assign_req_to_token_reference)
    fn(req_to_token, req_pool_indices, starts, ends, out_cache_loc)
