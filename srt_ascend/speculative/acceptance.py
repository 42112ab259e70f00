"""Which draft tokens a verify step keeps, and the one target token emitted after them.

Both functions return (accept_len [B], emitted [B, K+1]): `accept_len` counts accepted drafts
(0..K); `emitted[b, :accept_len+1]` are the accepted drafts followed by one target token (the
correction at the first rejection, or the bonus token after all K), and the rest is -1.
Probabilities come from `layers.sampler.processed_probs`, applied to the target and the draft
logits alike, so temperature/top-k/top-p/min-p shape both distributions before the test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from srt_ascend.layers.sampler import draw_uniforms, inverse_cdf_sample


class AcceptResult(NamedTuple):
    accept_len: torch.Tensor  # [B] int64, accepted drafts, 0..K
    emitted: torch.Tensor  # [B, K+1] int64, accepted drafts + 1 target token, then -1


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, K]
    target_argmax: torch.Tensor,  # [B, K+1], target's argmax after each verified position
) -> AcceptResult:
    """Greedy verification.

    Rule: accept the longest prefix of drafts with d_i == target_argmax[i-1]; then emit
    target_argmax[accept_len] (the correction, or the bonus when all K match). Since accepted
    drafts equal the target's argmax, emitted[:accept_len+1] == target_argmax[:accept_len+1].
    """
    k = draft_tokens.shape[1]
    matches = draft_tokens == target_argmax[:, :k]  # [B, K]
    accept_len = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    positions = torch.arange(k + 1, device=draft_tokens.device).view(1, -1)
    emitted = torch.where(positions <= accept_len.view(-1, 1), target_argmax, -1)
    return AcceptResult(accept_len, emitted.to(torch.int64))


def recovered_probs(
    target_probs: torch.Tensor,  # [..., V]
    draft_probs: torch.Tensor,  # [..., V]
) -> torch.Tensor:  # [..., V] float32, rows sum to 1
    """Distribution to resample from after a rejection.

    Rule: normalise(max(p_t - p_d, 0)); where that is all zero (p_t <= p_d everywhere, which
    only float rounding produces once a rejection happened), fall back to p_t.
    """
    target_probs = target_probs.to(torch.float32)
    residual = (target_probs - draft_probs.to(torch.float32)).clamp_(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    normalised = residual / mass.clamp(min=torch.finfo(torch.float32).tiny)
    fallback = target_probs / target_probs.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, normalised, fallback)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V]: p_d at each draft position (one-hot if greedy draft)
    target_probs: torch.Tensor,  # [B, K+1, V]: p_t after each verified position
    uniforms: torch.Tensor | None = None,  # [B, K+1] or [B, K], in (0, 1]
    generators: Sequence[torch.Generator | None] | None = None,  # [B]: draws what uniforms lack
) -> AcceptResult:
    """Speculative (rejection) sampling; the emitted tokens are distributed exactly as p_t.

    Rule, sequentially for i = 1..K: accept d_i iff U_i <= min(1, p_t[i-1](d_i) / p_d[i-1](d_i)),
    computed as U_i * p_d <= p_t with p_t > 0 so one-hot (greedy) drafts and p_d == 0 are safe.
    At the first rejection i, emit a token drawn from normalise(max(p_t[i-1] - p_d[i-1], 0));
    if all K are accepted, emit the bonus token drawn from p_t[K]. That draw inverts the CDF
    at U_{K+1}. Randomness: U_1..U_K(+1) from `uniforms`; whatever it lacks (all of it when
    None, U_{K+1} when it has K columns) comes from `draw_uniforms(generators)`, so a row with
    its own generator gets the same result whatever its batch neighbours are.
    """
    batch, k = draft_tokens.shape
    gens = generators if generators is not None else (None,) * batch
    if uniforms is None:
        uniforms = draw_uniforms(gens, k + 1, target_probs.device)
    elif uniforms.shape[1] == k:
        uniforms = torch.cat([uniforms, draw_uniforms(gens, 1, uniforms.device)], dim=1)
    draft_tokens = draft_tokens.to(torch.int64)
    accept_len = _accept_len(draft_tokens, draft_probs, target_probs, uniforms[:, :k])
    final_probs = _final_distribution(accept_len, draft_probs, target_probs)
    final_token = inverse_cdf_sample(final_probs, uniforms[:, k])  # [B]
    return AcceptResult(accept_len, _emit(draft_tokens, accept_len, final_token))


def _accept_len(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniforms: torch.Tensor,  # [B, K]
) -> torch.Tensor:  # [B] int64
    # Accept d_i iff p_t(d_i) > 0 and U_i * p_d(d_i) <= p_t(d_i); accept_len = leading accepts.
    k = draft_tokens.shape[1]
    index = draft_tokens.unsqueeze(-1)  # [B, K, 1]
    p_t = target_probs[:, :k].to(torch.float32).gather(-1, index).squeeze(-1)  # [B, K]
    p_d = draft_probs.to(torch.float32).gather(-1, index).squeeze(-1)  # [B, K]
    accepted = (p_t > 0) & (uniforms.to(torch.float32) * p_d <= p_t)
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _final_distribution(
    accept_len: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
) -> torch.Tensor:  # [B, V]
    # Position a = accept_len: recovered(p_t[a], p_d[a]) if a < K, else p_t[K] (the bonus),
    # which is recovered(p_t[K], 0).
    batch, k, vocab = draft_probs.shape
    index = accept_len.view(batch, 1, 1).expand(batch, 1, vocab)
    p_t = target_probs.gather(1, index).squeeze(1)  # [B, V]
    if k == 0:
        return recovered_probs(p_t, torch.zeros_like(p_t))
    p_d = draft_probs.gather(1, index.clamp(max=k - 1)).squeeze(1)  # [B, V]
    p_d = p_d * (accept_len < k).view(batch, 1).to(p_d.dtype)
    return recovered_probs(p_t, p_d)


def _emit(
    draft_tokens: torch.Tensor,  # [B, K]
    accept_len: torch.Tensor,  # [B]
    final_token: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, K+1]
    # emitted[j] = d_{j+1} for j < accept_len, final_token at j == accept_len, -1 after.
    batch, k = draft_tokens.shape
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    positions = torch.arange(k + 1, device=draft_tokens.device).view(1, -1)
    a = accept_len.view(-1, 1)
    emitted = torch.where(positions < a, padded, -1)
    return torch.where(positions == a, final_token.view(-1, 1), emitted)
