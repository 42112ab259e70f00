"""Logit penalties (repetition, frequency, presence), logit bias and min-new-tokens stop
masking.

Semantics follow vLLM/SGLang. The caller owns the per-request token statistics; for a
speculative verify batch, row j of a request must count the drafts d_1..d_j as generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.utils import to_device


def apply_penalties(
    logits: torch.Tensor,  # [B, V]
    info: SamplingBatchInfo,
    token_counts: torch.Tensor,  # [B, V] int: times each token was generated so far
    prompt_mask: torch.Tensor,  # [B, V] bool: token occurs in the prompt or the output
) -> torch.Tensor:  # [B, V] float32, a new tensor; `logits` is not modified
    """Return penalised logits.

    Rules, in this order, per row b and token v:
    - repetition (r = repetition_penalty): if v was seen (prompt_mask, or counted in
      token_counts), a positive logit is divided by r and a non-positive one multiplied by r;
    - frequency: logit -= frequency_penalty * count(v);
    - presence: logit -= presence_penalty * (count(v) > 0).
    Rows with neutral penalties (r = 1, 0, 0) come out unchanged.
    """
    out = logits.to(torch.float32, copy=True)
    if not info.need_penalties:
        return out
    counts = token_counts.to(torch.float32)
    seen = prompt_mask | (token_counts > 0)
    rep = info.repetition_penalties.view(-1, 1)
    repeated = torch.where(out > 0, out / rep, out * rep)
    out = torch.where(seen, repeated, out)
    out -= info.frequency_penalties.view(-1, 1) * counts
    out -= info.presence_penalties.view(-1, 1) * (counts > 0).to(torch.float32)
    return out


def mask_stop_tokens(
    logits: torch.Tensor,  # [B, V]
    rows: Sequence[int] | torch.Tensor,  # [R] rows still below their min_new_tokens
    stop_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,  # shared, or one per row
) -> torch.Tensor:  # [B, V], a new tensor; `logits` is not modified
    """Return logits where the stop tokens (EOS and stop_token_ids) of `rows` are -inf.

    Rule: a request that has produced fewer than min_new_tokens tokens may not stop, so its
    stop tokens get probability zero. `stop_ids` is either one list applied to every row in
    `rows`, or one list per entry of `rows`.
    """
    out = logits.clone()
    row_list = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if isinstance(stop_ids, torch.Tensor):
        stop_ids = stop_ids.tolist()
    if not row_list or len(stop_ids) == 0:
        return out
    per_row = isinstance(stop_ids[0], Sequence | torch.Tensor)
    if per_row and len(stop_ids) != len(row_list):
        raise ValueError(f"stop_ids has {len(stop_ids)} lists for {len(row_list)} rows.")
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(row_list):
        ids = stop_ids[i] if per_row else stop_ids
        row_idx.extend([row] * len(ids))
        tok_idx.extend(int(t) for t in ids)
    if row_idx:
        index = to_device([row_idx, tok_idx], out.device)
        out[index[0], index[1]] = float("-inf")
    return out


def apply_logit_bias(
    logits: torch.Tensor,  # [B, V]
    rows: Sequence[int],  # [R] rows with a bias
    biases: Sequence[dict[int, float]],  # [R] token id -> bias, one per entry of `rows`
) -> torch.Tensor:  # [B, V], a new tensor; `logits` is not modified
    """Return logits with each row's biases added to its tokens' logits (OpenAI's logit_bias:
    -100 or 100 in practice forbid or force a token)."""
    out = logits.clone()
    row_idx = [r for r, bias in zip(rows, biases) for _ in bias]
    tok_idx = [t for bias in biases for t in bias]
    vals = [v for bias in biases for v in bias.values()]
    if row_idx:
        index = to_device([row_idx, tok_idx], out.device)
        values = to_device(vals, out.device, out.dtype)
        out.index_put_((index[0], index[1]), values, accumulate=True)
    return out
