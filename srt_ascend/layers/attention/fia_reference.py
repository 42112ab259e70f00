"""Plain-torch reference of ``torch_npu.npu_fused_infer_attention_score`` (FIA).

Scope: the call vllm-ascend makes for DeepSeek MLA multi-query decode / target verify
(vllm_ascend/attention/mla_v1.py ``_forward_decode`` at commit 71c21f76f5, before the move to
``npu_fused_infer_attention_score_v2``)::

    torch_npu.npu_fused_infer_attention_score(
        q_nope, k_nope, k_nope,                  # [T, N, kv_lora_rank]; paged latent cache twice
        query_rope=q_pe, key_rope=k_pe,          # [T, N, rope_dim]; paged rope-key cache
        num_heads=N, num_key_value_heads=1, input_layout="TND_NTD" (or "TND"),
        atten_mask=triu(ones(2048, 2048), 1).to(int8), sparse_mode=3, scale=softmax_scale,
        antiquant_mode=0, antiquant_scale=None, block_table=[B, max_blocks] int32,
        block_size=bs, actual_seq_lengths=cumulative query ends, actual_seq_lengths_kv=kv lens)

On CPU/CUDA this function computes the same thing; ``npu_ops.fused_infer_attention_score`` picks
the real op for NPU tensors. Keyword names, layouts, defaults and validation follow the op.

Constraints, from the torch_npu API doc (Ascend/op-plugin
docs/context/torch_npu-npu_fused_infer_attention_score.md, "约束说明") unless noted:
  * TND/TND_NTD/NTD_TND: ``actual_seq_lengths`` and ``actual_seq_lengths_kv`` are required, the
    number of elements is the batch B; ``actual_seq_lengths`` holds cumulative query ends (each
    >= the previous one); T <= 1M; sparse only 0 without a mask or 3 with a mask.
  * MLA (query_rope/key_rope given): both or neither; query S per request 1-16 (also vllm-ascend
    ``decode_threshold <= 16`` assert in mla_v1.py, and seeds/000: "支持query每个batch的S为1-16");
    for D=512: Q_S == 1 only sparse 0 without mask, Q_S > 1 only sparse 3 with mask; layouts
    TND/TND_NTD; paged KV required; query N in {32, 64, 128}, key N == 1, D == 512, rope D == 64,
    block_size in {16, 128}; no softmax_lse, pse, prefix, anti-/post-quantisation.
  * sparse_mode 2/3/4: ``atten_mask`` of shape (2048, 2048), (1, 2048, 2048) or
    (1, 1, 2048, 2048), lower triangle 0 and upper triangle 1 (1/True = masked), dtype bool, int8
    or uint8; vllm-ascend builds it as ``torch.triu(torch.ones(2048, 2048), 1).to(torch.int8)``
    (attention_mask.py ``get_splitfuse_attn_mask``). pre_tokens/next_tokens are ignored.
  * sparse_mode 3 (rightDownCausal): query i of a request with q_len queries and kv_len keys sees
    keys j <= kv_len - q_len + i; for the int8-output path the doc rejects kv_len < q_len.
  * Page attention: block_table int32, 2-D, rows == B, columns >= the most blocks any request
    needs; key/value/key_rope in (num_blocks, block_size, N_kv * D) or
    (num_blocks, N_kv, block_size, D) (vllm-ascend: the latter, N_kv = 1), key and value of
    identical shape; num_blocks >= the sum of blocks the kv lengths need; block ids unchecked.
  * ``actual_seq_lengths_kv`` per request, not cumulative. "TND_NTD" returns [N, T, D].
  * Empty inputs: an empty query returns at once; empty key/value (S2 == 0) fills zeros.
  * softmax_lse_flag False returns a float32 zero tensor of shape [1] as the second output.
  * Graph padding (vllm-ascend mla_v1.py ``pad_actual_seq_len_q_mtp_*``, seeds/000 section on
    PD padding): padded requests have kv length 0 and 0..16 queries, e.g. [1, 2, 4, 5, 6, 6].

Deliberate differences: hardware limits (N, D, rope D, block_size values, fp16/bf16 only) are
not enforced, so tiny float32 CPU configs work; ``mla_npu_shape_problems`` lists them. A request
with kv_len 0 yields zeros (the op's empty-KV rule, applied per request). num_blocks >= sum of
blocks is not enforced (requests sharing radix-prefix blocks would trip it on small pools);
instead used block ids are range-checked, and the mask pattern is spot-checked.

Here: the op's entry point and its public helpers; its argument checks live in fia_checks,
its per-call plans (index tensors, the per-thread cache) and the attention math in
fia_plans (both private parts of this module: import from here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt_ascend.layers.attention.fia_checks import (
    MASK_SIZE,
    MAX_QUERY_TOKENS_PER_REQ,
    MAX_TOTAL_TOKENS,
    SPARSE_NO_MASK,
    SPARSE_RIGHT_DOWN_CAUSAL,
    SUPPORTED_LAYOUTS,
    _call_signature,
    _check_block_table,
    _check_extra_kwargs,
    _check_flags,
    _check_shapes,
    _check_sparse,
    _split_lengths,
)
from srt_ascend.layers.attention.fia_plans import (
    _CACHE,
    _adjacent,
    _attend_chunk,
    _paged_view,
    _plans,
    _same_view,
)

__all__ = [
    "MASK_SIZE",
    "MAX_QUERY_TOKENS_PER_REQ",
    "MAX_TOTAL_TOKENS",
    "SPARSE_NO_MASK",
    "SPARSE_RIGHT_DOWN_CAUSAL",
    "SUPPORTED_LAYOUTS",
    "build_compressed_causal_mask",
    "mla_npu_shape_problems",
    "npu_fused_infer_attention_score",
    "to_cumulative",
]


def build_compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """Return the 2048x2048 bool mask FIA needs for sparse_mode 3: True (masked) above the
    diagonal, False on and below it. The caller owns the new tensor; build it once."""
    ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def to_cumulative(q_lens: Sequence[int]) -> list[int]:
    """Per-request query lengths -> cumulative query ends (``actual_seq_lengths`` in TND)."""
    ends, total = [], 0
    for n in q_lens:
        if int(n) < 0:
            raise ValueError(f"query lengths must be >= 0, got {list(q_lens)}")
        total += int(n)
        ends.append(total)
    return ends


def mla_npu_shape_problems(
    num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, num_kv_heads: int = 1
) -> list[str]:
    """Hardware limits of FIA's MLA TND path (D=512) that the reference does not enforce.

    Returns one message per violated limit (empty when the shapes run on NPU), per the torch_npu
    doc's "query_rope和key_rope输入时即为MLA场景" section."""
    problems = []
    if num_heads not in (32, 64, 128):
        problems.append(f"query heads must be 32, 64 or 128, got {num_heads}")
    if num_kv_heads != 1:
        problems.append(f"key/value heads must be 1, got {num_kv_heads}")
    if kv_lora_rank != 512:
        problems.append(f"query/key D must be 512, got {kv_lora_rank}")
    if rope_dim != 64:
        problems.append(f"query_rope/key_rope D must be 64, got {rope_dim}")
    if block_size not in (16, 128):
        problems.append(f"block_size must be 16 or 128, got {block_size}")
    return problems


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    input_layout: str = "TND",
    num_key_value_heads: int = 0,
    block_size: int = 0,
    sparse_mode: int = 0,
    antiquant_mode: int = 0,
    antiquant_scale: torch.Tensor | None = None,
    softmax_lse_flag: bool = False,
    **unsupported: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged TND attention, MLA form: ``softmax(scale * (q.k + q_rope.k_rope) + mask) . v``.

    query [T, N, D], query_rope [T, N, Dr]; key/value/key_rope paged caches
    (num_blocks, block_size, N_kv * D) or (num_blocks, N_kv, block_size, D); value is usually the
    key cache itself (MLA latent). Returns ``(attention_out, softmax_lse)``: attention_out is
    [T, N, Dv] ("TND") or [N, T, Dv] ("TND_NTD") in query's dtype, newly allocated;
    softmax_lse is [T, N, 1] float32 with softmax_lse_flag, else a float32 zero of shape [1].
    Reads the inputs only. Raises ValueError for inputs the real op rejects (module docstring),
    TypeError for keywords the real op does not have.
    """
    kv_heads, batch = _checked_geometry(
        (query, key, value, query_rope, key_rope, block_table),
        (actual_seq_lengths, actual_seq_lengths_kv, atten_mask, antiquant_scale, unsupported),
        (num_heads, input_layout, num_key_value_heads, block_size, sparse_mode, antiquant_mode,
         softmax_lse_flag),
    )  # fmt: skip
    caches = [_paged_view(t, kv_heads, block_size) for t in (key, value, key_rope) if t is not None]
    causal = sparse_mode == SPARSE_RIGHT_DOWN_CAUSAL
    plans = _plans(batch, block_table, caches[0], num_heads, causal)
    out, lse = _attend(query, query_rope, caches, plans, (num_heads, scale, softmax_lse_flag))
    out = out.to(query.dtype)
    if input_layout == "TND_NTD":
        out = out.transpose(0, 1).contiguous()
    if softmax_lse_flag:
        return out, lse.unsqueeze(-1)
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _checked_geometry(tensors: tuple, lengths_and_extras: tuple, flags: tuple) -> tuple[int, list]:
    """Validate one call (ValueError / TypeError as the real op) and return its KV head count
    and per-request lengths. A call with the previous call's signature (and mask) reuses its
    verdict: the step path calls the op once per layer with the same geometry."""
    query, key, value, query_rope, key_rope, block_table = tensors
    q_lens, kv_lens, atten_mask, antiquant_scale, unsupported = lengths_and_extras
    num_heads, input_layout, num_kv_heads, block_size, sparse_mode, antiquant_mode, lse_flag = flags
    signature = _call_signature(tensors, q_lens, kv_lens, flags, antiquant_scale, unsupported)
    if signature is not None and _CACHE.checked_for(signature, atten_mask):
        return _CACHE.checked
    _check_extra_kwargs(unsupported)
    _check_flags(input_layout, antiquant_mode, antiquant_scale, lse_flag, query_rope)
    kv_heads = _check_shapes(query, key, value, query_rope, key_rope, num_heads, num_kv_heads)
    batch = _split_lengths(q_lens, kv_lens, query.shape[0])
    _check_sparse(sparse_mode, atten_mask, batch, mla=query_rope is not None)
    _check_block_table(block_table, block_size, batch, key)
    _CACHE.signature, _CACHE.checked = signature, (kv_heads, batch)
    _CACHE.checked_mask = atten_mask
    return kv_heads, batch


def _attend(query, query_rope, caches, plans, heads_scale_lse: tuple[int, float, bool]):
    """Attention over the plans' chunks: ``(out [T, N, Dv] float32, lse [T, N] or None)``."""
    num_heads, scale, lse_flag = heads_scale_lse
    num_tokens, dev = query.shape[0], query.device
    dv = caches[1].shape[-1]
    value_cols = None
    joint = _adjacent(caches[0], caches[2]) if query_rope is not None else None
    if joint is not None and _same_view(caches[0], caches[1]):
        # The MLA latent cache with its rope key right after it (how the FIA backend passes
        # them): one gather and one score matmul over [latent | rope]; values = the latent.
        query, query_rope, caches, value_cols = (
            torch.cat([query, query_rope], -1),
            None,
            [joint],
            dv,
        )
    if len(plans) == 1 and plans[0].t1 - plans[0].t0 == num_tokens and not lse_flag:
        return _attend_chunk(query, query_rope, caches, plans[0], scale, False, value_cols)[0], None
    out = torch.zeros(num_tokens, num_heads, dv, device=dev)
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=dev)
    for plan in plans:
        ctx, chunk_lse = _attend_chunk(query, query_rope, caches, plan, scale, lse_flag, value_cols)
        out[plan.t0 : plan.t1] = ctx
        if lse_flag:
            lse[plan.t0 : plan.t1] = chunk_lse
    return out, lse
