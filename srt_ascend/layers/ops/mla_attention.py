"""Paged MLA attention over the latent KV cache (absorbed weights): reference and dispatch.

Contract (the attention backends' one contract, `layers/attention/base.py`): row b has
q_lens[b] query tokens, packed at q_starts[b] .. q_starts[b] + q_lens[b] - 1 of the query
tensors, at positions seq_lens[b] - q_lens[b] .. seq_lens[b] - 1. Query i of row b attends to
KV positions 0 .. seq_lens[b] - q_lens[b] + i, whose slots are
req_to_token[req_pool_indices[b], position]. A key's score is q_latent . c_kv + q_pe . k_pe,
times `scale`; the output is the softmax-weighted sum of c_kv (MLA's value is the latent).
A query that sees no key (a padding row with seq_len 0) gets zeros. Scores, softmax and the
weighted sum are float32 whatever the input dtype; the output has q_latent's dtype.

This one shape covers decode (q_len 1), batch-expanded verify (K+1 single-query rows sharing a
request row, seq_lens differing by one), multi-query verify (one row of K+1 queries, causal
among them) and extend with a cached prefix. The cache is read through two tensors, c_kv
[slots, 1, R] and k_pe [slots, 1, P], with their own strides: they may be views of one
interleaved buffer (`MLATokenToKVPool`) or two separate buffers.
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops import pick


def mla_attention_reference(
    q_latent: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    c_kv: torch.Tensor,  # [slots, 1, R]
    k_pe: torch.Tensor,  # [slots, 1, P]
    req_to_token: torch.Tensor,  # [rows, max_context] slot of each (row, position)
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] KV length of each row, its queries included
    q_lens: torch.Tensor,  # [B] query tokens of each row
    q_starts: torch.Tensor,  # [B] index of each row's first query token in [T]
    scale: float,
) -> torch.Tensor:  # [T, H, R], q_latent's dtype
    """Row by row in plain torch (reads the lengths on the host): the semantics, not a fast
    path."""
    out = torch.zeros_like(q_latent)
    rows = zip(req_pool_indices.tolist(), seq_lens.tolist(), q_lens.tolist(), q_starts.tolist())
    for row, seq_len, q_len, start in rows:
        if q_len == 0:
            continue
        slots = req_to_token[row, :seq_len].to(torch.int64)
        lat, pe = c_kv[slots, 0].float(), k_pe[slots, 0].float()  # [L, R], [L, P]
        q_lat = q_latent[start : start + q_len].float()  # [q, H, R]
        scores = (q_lat @ lat.T + q_pe[start : start + q_len].float() @ pe.T) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device)
        visible = torch.arange(seq_len, device=scores.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))  # [q, H, L]
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[start : start + q_len] = (probs @ lat).to(out.dtype)
    return out


def _reference_with_plan(*args, max_q_len: int, num_kv_splits: int):
    return mla_attention_reference(*args)


def _load_triton():
    from srt_ascend.layers.ops import mla_attention_triton

    return mla_attention_triton.mla_attention


# device type -> loader of the implementation; NPU attention goes through FIA instead
_IMPLS = {"cuda": _load_triton}


def mla_attention(
    q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
    scale: float, *, max_q_len: int, num_kv_splits: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Dispatches by the device of `q_latent`: the Triton kernel on CUDA, the reference
    elsewhere. `max_q_len` (>= every q_lens[b]) and `num_kv_splits` are host-side launch
    geometry; the kernel reads every length on the device."""
    fn = pick(_IMPLS, q_latent.device, _reference_with_plan)
    return fn(
        q_latent, q_pe, c_kv, k_pe, req_to_token, req_pool_indices, seq_lens, q_lens, q_starts,
        scale, max_q_len=max_q_len, num_kv_splits=num_kv_splits,
    )  # fmt: skip


MIN_PART_KEYS = 256  # a KV part is never shorter: a row's KV up to this length is one part


def plan_kv_splits(batch: int, num_q_blocks: int, num_head_blocks: int, max_kv_len: int) -> int:
    """How many parts each row's KV is split into (flash-decoding), from host values only.

    Enough programs to fill a large GPU (~256 in flight) when the batch alone does not, but
    never parts shorter than 256 keys, whose partial results would cost more to combine than
    they save."""
    programs = max(1, batch * num_q_blocks * num_head_blocks)
    by_occupancy = max(1, 256 // programs)
    by_length = max(1, -(-max_kv_len // MIN_PART_KEYS))
    return min(by_occupancy, by_length, 64)
