"""Torch-native MLA attention over the paged latent cache: plain torch, vectorised over rows.

The project's "flashinfer-free custom op": every row is padded to the batch's longest query and
KV length, one masked einsum computes all rows at once, and padding is dropped afterwards. The
same code serves EXTEND, DECODE, batch-expanded TARGET_VERIFY and DRAFT_EXTEND.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt_ascend.layers.attention.base import AttentionBackend, register_attention_backend

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


@dataclass
class PaddedRows:
    """Per-batch gather plan shared by all layers."""

    kv_slots: torch.Tensor  # [B, Lmax] slot of key j of row b (0 = padding slot)
    blocked: torch.Tensor  # [B, Qmax, 1, Lmax] True where query i of row b may not see key j
    token_row: torch.Tensor | None  # [T] row of each packed query token (None: uniform rows)
    token_col: torch.Tensor | None  # [T] index of the token inside its row
    max_q: int


def build_padded_rows(fb: ForwardBatch) -> PaddedRows:
    """Rows padded to the longest query and KV length. Under static shapes (graph capture)
    the KV window is `fb.static_kv_len` and every row has the same query length, so nothing
    here reads a device value on the host."""
    seq_lens, q_lens = fb.seq_lens, fb.extend_seq_lens
    b = fb.batch_size
    uniform_q = len(set(fb.extend_seq_lens_cpu)) <= 1
    max_q = fb.extend_seq_lens_cpu[0] if fb.extend_seq_lens_cpu else 0
    if fb.static_shapes:
        if not uniform_q:
            raise ValueError("static-shape torch_native attention needs one query length per row")
        max_kv = fb.static_kv_len
    else:
        max_kv = max(fb.seq_lens_cpu, default=0)
        max_q = max(fb.extend_seq_lens_cpu, default=0)
    device = seq_lens.device
    cols = torch.arange(max_kv, device=device)
    rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_kv]  # [B, Lmax]
    kv_valid = cols[None, :] < seq_lens[:, None]
    kv_slots = torch.where(kv_valid, rows, torch.zeros_like(rows))
    # Query i of row b sits at position seq_len - q_len + i and sees keys j <= that position.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    blocked = (cols[None, None, :] > q_pos[:, :, None]) | ~kv_valid[:, None, :]
    if uniform_q:  # packed tokens are already [B, q] row-major: a reshape, no scatter
        return PaddedRows(kv_slots, blocked.unsqueeze(2), None, None, max_q)
    # output_size: without it repeat_interleave reads the lengths' sum on the host (a sync)
    token_row = torch.repeat_interleave(
        torch.arange(b, device=device), q_lens, output_size=fb.num_tokens
    )
    starts = torch.cumsum(q_lens, 0) - q_lens
    token_col = torch.arange(fb.num_tokens, device=device) - starts[token_row]
    return PaddedRows(kv_slots, blocked.unsqueeze(2), token_row, token_col, max_q)


@register_attention_backend("torch_native")
class TorchNativeMLABackend(AttentionBackend):
    supports_static_shapes = True
    reads_whole_kv_window = True  # gathers [B, static_kv_len] slots per layer

    def __init__(self, **_: object) -> None:
        pass

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = build_padded_rows(forward_batch)

    def forward(self, q_latent, q_pe, c_kv, k_pe, layer_id, scale, forward_batch):
        """Scores, softmax and the weighted sum run in float32 whatever the model dtype (as
        fused attention kernels accumulate): exact for float32 models, more precise for
        bf16 ones, and on CPU free of oneDNN's per-shape bf16 kernel set-up (KV lengths
        change every step)."""
        pool = forward_batch.token_to_kv_pool
        pool.set_mla_kv_buffer(layer_id, forward_batch.out_cache_loc, c_kv, k_pe)
        meta: PaddedRows = forward_batch.attn_metadata
        b, h, rank = forward_batch.batch_size, q_latent.shape[1], q_latent.shape[-1]
        kv = pool.gather_kv(layer_id, meta.kv_slots).float()  # [B, L, R+P]
        q = torch.cat([q_latent, q_pe], dim=-1).float()  # [T, H, R+P]: one score matmul
        if meta.token_row is not None:
            padded = q.new_zeros(b, meta.max_q, h, q.shape[-1])
            padded[meta.token_row, meta.token_col] = q
            q = padded
        q = q.view(b, meta.max_q * h, -1)
        scores = torch.bmm(q, kv.transpose(1, 2)).view(b, meta.max_q, h, -1) * scale
        scores = scores.masked_fill_(meta.blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows with no key: zeros
        out = self.weighted_sum(probs.view(b, meta.max_q * h, -1), kv[..., :rank])
        out = out.view(b, meta.max_q, h, rank).to(q_latent.dtype)
        if meta.token_row is None:
            return out.view(-1, h, rank)  # [T, H, R]
        return out[meta.token_row, meta.token_col]

    def weighted_sum(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """probs [B, M, L] @ values [B, L, R] (float32): the one reduction over keys."""
        return torch.bmm(probs, values)
