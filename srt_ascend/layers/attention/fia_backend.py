"""Multi-query MLA attention through `npu_fused_infer_attention_score` (FIA), TND layout.

Used for TARGET_VERIFY: one row of 1+K query tokens per request, causal inside the row
(sparse_mode 3 with the compressed 2048x2048 mask), paged KV through a block table. On NPU the
call goes to torch_npu; elsewhere to the reference op with the same contract (fia_reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt_ascend.layers.attention.base import AttentionBackend, register_attention_backend
from srt_ascend.layers.attention.fia_reference import build_compressed_causal_mask, to_cumulative
from srt_ascend.layers.attention.npu_ops import fused_infer_attention_score

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


@dataclass
class FiaMetadata:
    block_table: torch.Tensor  # [B, max_blocks] int32: page ids of each request's KV
    actual_seq_lengths: list[int]  # cumulative query ends
    actual_seq_lengths_kv: list[int]  # KV length per request


def build_block_table(fb: ForwardBatch) -> torch.Tensor:
    """Page id of every page of each row: the slot of the page's first position // page size
    (the pool's pages). Under static shapes the table covers the whole KV window (unused pages
    point at page 0)."""
    page_size = fb.token_to_kv_pool.page_size
    if fb.static_shapes:
        max_blocks = -(-fb.static_kv_len // page_size)
    else:
        max_blocks = max((-(-s // page_size) for s in fb.seq_lens_cpu), default=0)
    cols = torch.arange(max_blocks, device=fb.seq_lens.device) * page_size
    firsts = fb.req_to_token_pool.req_to_token[fb.req_pool_indices][:, cols]  # [B, max_blocks]
    return (firsts // page_size).to(torch.int32)


def paged_cache(cache: torch.Tensor, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool cache [slots, 1, D] as FIA's paged key [slots // page_size, page_size, D]: a
    view (no copy) when the pool already holds `dtype`."""
    return cache.view(cache.shape[0] // page_size, page_size, cache.shape[-1]).to(dtype)


@register_attention_backend("fia")
class FiaMLABackend(AttentionBackend):
    supports_static_shapes = True
    uses_host_lengths = True  # actual_seq_lengths(_kv) are host lists: refreshed per replay

    def __init__(self, **_: object) -> None:
        self._mask: torch.Tensor | None = None

    def _causal_mask(self, device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = build_compressed_causal_mask(device)
        return self._mask

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = FiaMetadata(
            build_block_table(forward_batch),
            to_cumulative(forward_batch.extend_seq_lens_cpu),
            list(forward_batch.seq_lens_cpu),
        )

    def forward(self, q_latent, q_pe, c_kv, k_pe, layer_id, scale, forward_batch):
        pool = forward_batch.token_to_kv_pool
        pool.set_mla_kv_buffer(layer_id, forward_batch.out_cache_loc, c_kv, k_pe)
        meta: FiaMetadata = forward_batch.attn_metadata
        # The op's paged caches: [num_blocks, block_size, D], slot = block * ps + offset.
        # Separate pool layout (NPU): two contiguous caches; interleaved (CPU/CUDA): column
        # views of one buffer, which the reference reads with one gather.
        latent = paged_cache(pool.get_c_kv(layer_id), pool.page_size, q_latent.dtype)
        rope = paged_cache(pool.get_k_pe(layer_id), pool.page_size, q_latent.dtype)
        out, _ = fused_infer_attention_score(
            q_latent,
            latent,
            latent,
            query_rope=q_pe,
            key_rope=rope,
            num_heads=q_latent.shape[1],
            num_key_value_heads=1,
            input_layout="TND",
            atten_mask=self._causal_mask(q_latent.device),
            sparse_mode=3,
            scale=scale,
            antiquant_mode=0,
            antiquant_scale=None,
            block_table=meta.block_table,
            block_size=pool.page_size,
            actual_seq_lengths=meta.actual_seq_lengths,
            actual_seq_lengths_kv=meta.actual_seq_lengths_kv,
        )
        return out
