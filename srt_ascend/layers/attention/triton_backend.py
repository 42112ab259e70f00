"""MLA attention through the Triton paged kernel (`layers/ops/mla_attention_triton.py`).

SGLang's `--attention-backend triton`; the default on CUDA. One kernel serves every forward
mode (extend with a cached prefix, decode, both verify layouts, draft extend): the kernel reads
lengths and req_to_token rows on the device, so the launch depends only on host values (batch
size, the longest query, the number of KV parts) and a graph captured per batch bucket replays
for any KV length. Under `fb.static_shapes` nothing is read from the device on the host; the KV
parts are planned from the static window. On CPU the kernels run only under Triton's
interpreter (`TRITON_INTERPRET=1`, the tests); torch_native is the CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt_ascend.layers.attention.base import AttentionBackend, register_attention_backend
from srt_ascend.layers.ops.mla_attention import MIN_PART_KEYS, plan_kv_splits

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


@dataclass
class TritonMetadata:
    q_starts: torch.Tensor  # [B] index of each row's first query token
    max_q_len: int  # host: the longest query of a row (launch geometry)
    max_kv_len: int  # host: the longest KV (the static window under graphs), plans KV parts
    kv_parts: dict | None = None  # the kernel's KV split arguments, planned at the first layer


@register_attention_backend("triton")
class TritonMLABackend(AttentionBackend):
    supports_static_shapes = True
    serves_multi_query_verify = True

    def __init__(self, **_: object) -> None:
        from srt_ascend.layers.ops import mla_attention_triton

        self._attn = mla_attention_triton

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.seq_lens.device.type == "cpu" and not self._attn.INTERPRETED:
            raise RuntimeError(
                "attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 set "
                "before Triton is imported); use torch_native on CPU"
            )
        max_kv = fb.static_kv_len if fb.static_shapes else max(fb.seq_lens_cpu, default=0)
        fb.attn_metadata = TritonMetadata(
            fb.extend_start_loc, max(fb.extend_seq_lens_cpu, default=1), max_kv
        )

    def forward(self, q_latent, q_pe, c_kv, k_pe, layer_id, scale, forward_batch):
        fb = forward_batch
        pool = fb.token_to_kv_pool
        pool.set_mla_kv_buffer(layer_id, fb.out_cache_loc, c_kv, k_pe)  # the store_kv op
        c_kv_buf, k_pe_buf = pool.get_c_kv(layer_id), pool.get_k_pe(layer_id)
        meta: TritonMetadata = fb.attn_metadata
        if meta.kv_parts is None:  # once per forward: every layer has the same geometry
            meta.kv_parts = self.kv_parts(fb.batch_size, q_latent, meta)
        return self._attn.mla_attention(
            q_latent,
            q_pe,
            c_kv_buf,
            k_pe_buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.extend_seq_lens,
            meta.q_starts,
            scale,
            max_q_len=meta.max_q_len,
            **meta.kv_parts,
        )

    fixed_tile = False  # the batch-invariant variant's tile ignores the query length

    def warm_up_lengths(self, num_heads: int, max_kv_len: int) -> list[tuple[int, int]]:
        """Per tile height (`q_len_buckets`): the query alone (one KV part) and, where the
        context holds more than one part's keys, over up to 512 keys (a lone row splits them
        into parts of at most 256, `plan_kv_splits` and `INVARIANT_KV_SPLIT` alike). The
        launch's other values (query blocks, parts) are plain kernel arguments."""
        long = min(max_kv_len, 2 * MIN_PART_KEYS)
        lengths = []
        for q in self._attn.q_len_buckets(num_heads, self.fixed_tile):
            lengths.append((q, q))
            if long > max(MIN_PART_KEYS, self._attn.INVARIANT_KV_SPLIT, q):
                lengths.append((q, long))
        return lengths

    def kv_parts(self, batch: int, q_latent: torch.Tensor, meta: TritonMetadata) -> dict:
        """The kernel's KV split arguments for queries `q_latent` [T, H, R]: as many parts as
        fill the GPU (plan_kv_splits) over the programs the launch's tile leaves."""
        pl = self._attn.launch_plan(q_latent, meta.max_q_len)
        heads = q_latent.shape[1]
        return {
            "num_kv_splits": plan_kv_splits(
                batch, -(-meta.max_q_len // pl.block_q), -(-heads // pl.block_h), meta.max_kv_len
            )
        }


@register_attention_backend("triton_batch_invariant")
class TritonBatchInvariantMLABackend(TritonMLABackend):
    """`--enable-deterministic-inference` with the triton backend: the same kernel with its
    tile fixed and its KV parts at fixed key positions (`INVARIANT_KV_SPLIT` keys each, as
    many as cover the longest KV, merged one by one in key order), so every query's result is
    a function of its own query and keys alone, in every forward mode and graph bucket."""

    fixed_tile = True

    def kv_parts(self, batch: int, q_latent: torch.Tensor, meta: TritonMetadata) -> dict:
        size = self._attn.INVARIANT_KV_SPLIT
        return {
            "num_kv_splits": self._attn.invariant_kv_splits(meta.max_kv_len, size),
            "kv_split_size": size,
        }
