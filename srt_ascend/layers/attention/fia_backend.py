"""Multi-query MLA attention through `npu_fused_infer_attention_score` (FIA), TND layout.

Used for TARGET_VERIFY: one row of 1+K query tokens per request, causal inside the row
(sparse_mode 3 with the compressed 2048x2048 mask), paged KV through a block table. On NPU the
call goes to torch_npu; elsewhere to the reference op with the same contract (fia_reference).

Inside a torch.compile'd forward the lengths come from the batch's device tensors (refreshed
by the graph runner at each replay), so the compiled graph neither breaks on host-side
planning nor specialises on the lengths of the batch it was traced with. Where the real op
runs (NPU) it is called through one opaque custom op that reads them to the host. Elsewhere
the same attention is written in tensor ops over the graph's fixed KV window
(`_fia_mla_in_graph`: one padded row per request, as the reference plans it), which the
compiler fuses: the opaque reference, with its per-layer host planning and dozens of small
eager ops, made a compiled CPU verify cost 2.3-2.6x a compiled decode at one request
(benchmark/README.md, 2026-12-01).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt_ascend.layers.attention.base import AttentionBackend, register_attention_backend
from srt_ascend.layers.attention.fia_reference import (
    MAX_QUERY_TOKENS_PER_REQ,
    build_compressed_causal_mask,
    to_cumulative,
)
from srt_ascend.layers.attention.npu_ops import fused_infer_attention_score, has_device_fia

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


@dataclass
class FiaMetadata:
    block_table: torch.Tensor  # [B, max_blocks] int32: page ids of each request's KV
    actual_seq_lengths: list[int] | None  # cumulative query ends (None: compiled)
    actual_seq_lengths_kv: list[int] | None  # KV length per request (None: compiled)
    max_q: int = 0  # compiled: the most query tokens a request with KV holds


@torch.library.custom_op("srt_ascend::fia_reference_mla", mutates_args=())
def fia_reference_mla(
    query: torch.Tensor,
    latent: torch.Tensor,
    query_rope: torch.Tensor,
    rope: torch.Tensor,
    mask: torch.Tensor,
    block_table: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """The FIA reference (MLA, TND, causal) with per-request query and KV lengths given as
    tensors [B]; read to the host here, outside any compiled graph. -> [T, H, R]."""
    out = _fia_mla(
        query,
        latent,
        query_rope,
        rope,
        mask,
        block_table,
        scale,
        block_size,
        to_cumulative(q_lens.tolist()),
        kv_lens.tolist(),
    )
    return out.contiguous()  # one layout whatever the reference's path: what the fake says


def _fia_mla(
    query: torch.Tensor,  # [T, H, R] latent queries
    latent: torch.Tensor,  # paged [blocks, block_size, R]
    query_rope: torch.Tensor,
    rope: torch.Tensor,  # paged [blocks, block_size, P]
    mask: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    block_size: int,
    q_ends: list[int],  # cumulative query ends
    kv_lens: list[int],
) -> torch.Tensor:
    """The one FIA call this backend makes: MLA (key = value = the latent), TND, causal."""
    out, _ = fused_infer_attention_score(
        query,
        latent,
        latent,
        query_rope=query_rope,
        key_rope=rope,
        num_heads=query.shape[1],
        num_key_value_heads=1,
        input_layout="TND",
        atten_mask=mask,
        sparse_mode=3,
        scale=scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=kv_lens,
    )
    return out


@fia_reference_mla.register_fake
def _(query, latent, query_rope, rope, mask, block_table, q_lens, kv_lens, scale, block_size):
    return query.new_empty(query.shape)


def _fia_mla_in_graph(
    query: torch.Tensor,  # [T, H, R] latent queries
    query_rope: torch.Tensor,  # [T, H, P]
    pool,
    layer_id: int,
    block_table: torch.Tensor,  # [B, max_blocks] int32
    q_lens: torch.Tensor,  # [B] query tokens per request (sum T)
    kv_lens: torch.Tensor,  # [B]
    scale: float,
    page_size: int,
    max_q: int,
) -> torch.Tensor:
    """What the reference computes for a compiled forward (MLA, TND, sparse_mode 3), in tensor
    ops with no host read: each request's first `max_q` query tokens as one padded row over
    its KV window (the block table's width), keys past each token's causal bound masked.
    Float32 scores, softmax and weighted sum as the reference. A request with KV length 0
    (padding) yields zeros, and only such a request may hold more than `max_q` tokens (a
    verify graph's spare slots: `fia_padded_query_lens`); their tokens past `max_q` get zeros
    too. -> [T, H, R] in query's dtype."""
    dev, num_tokens, heads, rank = query.device, query.shape[0], query.shape[1], query.shape[2]
    q_lens, kv_lens = q_lens.long(), kv_lens.long()
    b = q_lens.shape[0]
    starts = torch.cumsum(q_lens, 0) - q_lens
    j = torch.arange(max_q, device=dev)
    live = j[None, :] < q_lens[:, None]  # [B, max_q] query j of request b exists
    pos = torch.arange(block_table.shape[1] * page_size, device=dev)
    slots = block_table.long()[:, pos // page_size] * page_size + pos % page_size  # [B, W]
    slots = torch.where(pos[None, :] < kv_lens[:, None], slots, 0)
    keys = pool.gather_kv(layer_id, slots)  # [B, W, R+P]
    keys = keys.to(query.dtype).float()  # the reference reads the caches in query's dtype
    q = torch.cat([query, query_rope], dim=-1).float()  # [T, H, R+P]: one score matmul
    q = q[torch.where(live, starts[:, None] + j[None, :], 0)]  # [B, max_q, H, R+P]
    scores = torch.bmm(q.view(b, max_q * heads, -1), keys.transpose(1, 2)) * scale
    last = (kv_lens - q_lens)[:, None] + j[None, :]  # rightDownCausal: the last key seen
    seen = (pos[None, None, :] <= last[:, :, None]) & live[:, :, None]  # [B, max_q, W]
    scores = scores.view(b, max_q, heads, -1).masked_fill(~seen[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no key seen: zeros
    ctx = torch.bmm(probs.view(b, max_q * heads, -1), keys[..., :rank])
    ctx = ctx.view(b, max_q, heads, rank)
    # back to TND: token t is query i of request req (output_size: no host read of the sum)
    req = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=num_tokens)
    i = torch.arange(num_tokens, device=dev) - starts[req]
    out = ctx[req, i.clamp(max=max_q - 1)]
    return torch.where((i < max_q)[:, None, None], out, 0.0).to(query.dtype)


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

    def takes_length_bounds(self, device: torch.device) -> bool:
        """Off NPU the attention of such a batch is written in tensor ops reading the device
        lengths (as in a compiled forward); NPU's op takes the exact lengths on the host."""
        return not has_device_fia(device.type)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if torch.compiler.is_compiling() or not fb.host_lengths_exact:
            # the lengths come from the device tensors (compiled: a graph's constant query
            # bound; eager with host bounds: the batch's one query length)
            max_q = fb.static_max_q or (
                MAX_QUERY_TOKENS_PER_REQ if fb.static_shapes else max(fb.extend_seq_lens_cpu)
            )
            fb.attn_metadata = FiaMetadata(build_block_table(fb), None, None, max_q)
            return
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
        if meta.actual_seq_lengths is None and not has_device_fia(q_latent.device.type):
            return _fia_mla_in_graph(
                q_latent,
                q_pe,
                pool,
                layer_id,
                meta.block_table,
                forward_batch.extend_seq_lens,
                forward_batch.seq_lens,
                scale,
                pool.page_size,
                meta.max_q,
            )
        mask = self._causal_mask(q_latent.device)
        if meta.actual_seq_lengths is None:
            return fia_reference_mla(
                q_latent,
                latent,
                q_pe,
                rope,
                mask,
                meta.block_table,
                forward_batch.extend_seq_lens,
                forward_batch.seq_lens,
                scale,
                pool.page_size,
            )
        return _fia_mla(
            q_latent,
            latent,
            q_pe,
            rope,
            mask,
            meta.block_table,
            scale,
            pool.page_size,
            meta.actual_seq_lengths,
            meta.actual_seq_lengths_kv,
        )
