"""Which draft tokens a verify step keeps, and the one target token emitted after them.

Every rule returns (accept_len [B], emitted [B, K+1]): `accept_len` counts accepted drafts
(0..k_r, where `limits` [B] gives each row its own k_r in 0..K, K when None);
`emitted[b, :accept_len+1]` are the accepted drafts followed by one target token (the
correction at the first rejection, or the bonus token after all k_r), and the rest is -1.
A row with limit k_r gets exactly what a K = k_r step over the same drafts and uniforms gives
(drafts past k_r never accepted, the bonus from p_t[k_r] at U_{k_r+1}): its result and its
randomness do not depend on its neighbours' lengths.
Probabilities come from `layers.sampler.processed_probs`, applied to the target and the draft
logits alike, so temperature/top-k/top-p/min-p shape both distributions before the test.

Devices: greedy and token-wise rejection sampling run the chain-acceptance op
(`layers/ops/spec_accept.py`: its Triton kernels on CUDA, and on NPU where Triton-Ascend is
installed; its torch reference elsewhere). Block verification is plain torch on every device
(a handful of [B, K] and [B, K, V] tensor ops; no kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from srt_ascend.layers.linear import sum_last
from srt_ascend.layers.ops import spec_accept
from srt_ascend.layers.sampler import draw_uniforms, inverse_cdf_sample


class AcceptResult(NamedTuple):
    accept_len: torch.Tensor  # [B] int64, accepted drafts, 0..K
    emitted: torch.Tensor  # [B, K+1] int64, accepted drafts + 1 target token, then -1


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, K]
    target_argmax: torch.Tensor,  # [B, K+1], target's argmax after each verified position
    limits: torch.Tensor | None = None,  # [B] int64 k_r in 0..K (None: K)
) -> AcceptResult:
    """Greedy verification.

    Rule: accept the longest prefix of drafts with d_i == target_argmax[i-1]; then emit
    target_argmax[accept_len] (the correction, or the bonus when all K match). Since accepted
    drafts equal the target's argmax, emitted[:accept_len+1] == target_argmax[:accept_len+1].
    Runs `spec_accept.greedy_accept` (dispatch by device).
    """
    return AcceptResult(*spec_accept.greedy_accept(draft_tokens, target_argmax, limits))


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
    mass = sum_last(residual)  # the sums: batch-invariant on CUDA in deterministic mode
    normalised = residual / mass.clamp(min=torch.finfo(torch.float32).tiny)
    fallback = target_probs / sum_last(target_probs)
    return torch.where(mass > 0, normalised, fallback)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V]: p_d at each draft position (one-hot if greedy draft)
    target_probs: torch.Tensor,  # [B, K+1, V]: p_t after each verified position
    uniforms: torch.Tensor | None = None,  # [B, K+1] or [B, K], in (0, 1]
    generators: Sequence[torch.Generator | None] | None = None,  # [B]: draws what uniforms lack
    limits: torch.Tensor | None = None,  # [B] int64 k_r in 0..K (None: K)
) -> AcceptResult:
    """Speculative (rejection) sampling; the emitted tokens are distributed exactly as p_t.

    Rule, sequentially for i = 1..K: accept d_i iff U_i <= min(1, p_t[i-1](d_i) / p_d[i-1](d_i)),
    computed as U_i * p_d <= p_t with p_t > 0 so one-hot (greedy) drafts and p_d == 0 are safe.
    At the first rejection i, emit a token drawn from normalise(max(p_t[i-1] - p_d[i-1], 0));
    if all K are accepted, emit the bonus token drawn from p_t[K]. That draw inverts the CDF
    at U_{K+1}. Randomness: U_1..U_K(+1) from `uniforms`; whatever it lacks (all of it when
    None, U_{K+1} when it has K columns) comes from `draw_uniforms(generators)`, so a row with
    its own generator gets the same result whatever its batch neighbours are. The rule runs
    as `spec_accept.rejection_sample` (dispatch by device) over those uniforms.
    """
    k = draft_tokens.shape[1]
    uniforms = _uniforms(draft_tokens.shape[0], k, uniforms, generators, target_probs.device)
    draft_tokens = draft_tokens.to(torch.int64)
    return AcceptResult(
        *spec_accept.rejection_sample(draft_tokens, draft_probs, target_probs, uniforms, limits)
    )


def block_verify(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V]: p_d at each draft position (one-hot if greedy draft)
    target_probs: torch.Tensor,  # [B, K+1, V]: p_t after each verified position
    uniforms: torch.Tensor | None = None,  # [B, K+1] or [B, K], in (0, 1]
    generators: Sequence[torch.Generator | None] | None = None,  # [B]: draws what uniforms lack
    limits: torch.Tensor | None = None,  # [B] int64 k_r in 0..K (None: K)
) -> AcceptResult:
    """Block verification (Sun et al., ICLR 2025, Algorithm 2): the drafts are accepted as a
    block, the emitted tokens are distributed exactly as p_t, and in expectation at least as
    many drafts are accepted as by `rejection_sample` (Theorem 2 of the paper).

    Rule, with p_0 = 1 and for i = 1..K (p_t, p_d at draft i are those after i-1 drafts):
      p_i = min(1, p_{i-1} * p_t[i-1](d_i) / p_d[i-1](d_i))   (0 where p_t[i-1](d_i) = 0)
      r_i = sum_x max(p_i * p_t[i](x) - p_d[i](x), 0)          (i < K)
      h_i = r_i / (r_i + 1 - p_i) for i < K (0 when both are 0), h_K = p_K;
    accept_len tau = the largest i with U_i <= h_i (0 if none): unlike the token-wise rule a
    later draft may rescue an earlier rejection. Then emit a token drawn from
    normalise(max(p_tau * p_t[tau] - p_d[tau], 0)) if tau < K, else from p_t[K] (the bonus),
    by inverting the CDF at U_{K+1}. Given the drafts so far, P(tau >= i) = p_i, so the
    expected accepted length is sum_i E[p_i]. Randomness as in `rejection_sample`: a row with
    its own generator gets the same result whatever its batch neighbours are. One-hot targets
    (greedy rows) give exactly `greedy_accept`. With a limit k_r: h_{k_r} = p_{k_r}, and
    positions past k_r never hit.
    """
    batch, k = draft_tokens.shape
    device = target_probs.device
    uniforms = _uniforms(batch, k, uniforms, generators, device)
    limit = spec_accept.full_limits(limits, batch, k, device).view(-1, 1)  # [B, 1]
    draft_tokens = draft_tokens.to(torch.int64)
    target_probs, draft_probs = target_probs.to(torch.float32), draft_probs.to(torch.float32)
    weights = _block_weights(draft_tokens, draft_probs, target_probs)  # [B, K+1]: p_0..p_K
    stop = _block_stop_probs(weights, draft_probs, target_probs)  # [B, K]: h_1..h_K
    positions = torch.arange(1, k + 1, device=draft_tokens.device).view(1, -1)
    stop = torch.where(positions == limit, weights[:, 1:], stop)  # h_{k_r} = p_{k_r}
    hit = (positions <= limit) & (uniforms[:, :k].to(torch.float32) <= stop)
    hits = torch.where(hit, positions, 0)  # [B, K]
    accept_len = torch.cat([hits.new_zeros(batch, 1), hits], dim=1).amax(dim=1)  # [B]
    index = accept_len.view(batch, 1)
    scale = weights.gather(1, index)  # [B, 1] p_tau
    vocab = target_probs.shape[-1]
    p_t = target_probs.gather(1, index.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    if k == 0:
        p_d = torch.zeros_like(p_t)
    else:
        at = index.clamp(max=k - 1).view(batch, 1, 1).expand(batch, 1, vocab)
        p_d = draft_probs.gather(1, at).squeeze(1) * (index < limit)
    final_u = uniforms.gather(1, limit).squeeze(1)  # U_{k_r+1}
    final_token = inverse_cdf_sample(recovered_probs(scale * p_t, p_d), final_u)
    return AcceptResult(accept_len, _emit(draft_tokens, accept_len, final_token))


# --speculative-accept-method: the sampled-row rule (greedy rows are exact either way)
ACCEPT_METHODS = {"token": rejection_sample, "block": block_verify}


def _block_weights(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V] float32
    target_probs: torch.Tensor,  # [B, K+1, V] float32
) -> torch.Tensor:  # [B, K+1]: p_0 = 1, p_1..p_K
    # p_i = min(1, p_{i-1} * p_t(d_i) / p_d(d_i)), written as a comparison so p_d = 0 and
    # one-hot drafts are safe; p_t(d_i) = 0 gives 0 (the token-wise rule's p_t > 0 test).
    k = draft_tokens.shape[1]
    index = draft_tokens.unsqueeze(-1)
    p_t = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [B, K]
    p_d = draft_probs.gather(-1, index).squeeze(-1)  # [B, K]
    weights = [p_t.new_ones(p_t.shape[0])]
    for i in range(k):
        num = weights[-1] * p_t[:, i]
        ratio = num / p_d[:, i].clamp(min=torch.finfo(torch.float32).tiny)
        weight = torch.where(num >= p_d[:, i], 1.0, ratio)
        weights.append(torch.where(p_t[:, i] > 0, weight, 0.0))
    return torch.stack(weights, dim=1)


def _block_stop_probs(
    weights: torch.Tensor,  # [B, K+1] p_0..p_K
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
) -> torch.Tensor:  # [B, K]: h_1..h_K
    # h_i = r_i / (r_i + 1 - p_i) with r_i = sum_x max(p_i p_t[i] - p_d[i], 0), i < K; h_K = p_K.
    k = draft_probs.shape[1]
    if k == 0:
        return weights[:, :0]
    p = weights[:, 1:k]  # [B, K-1]
    residual = (p.unsqueeze(-1) * target_probs[:, 1:k] - draft_probs[:, 1:k]).clamp(min=0.0)
    r = sum_last(residual).squeeze(-1)  # [B, K-1]
    denom = r + (1.0 - p)
    h = torch.where(denom > 0, r / denom.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return torch.cat([h, weights[:, k:]], dim=1)


def _uniforms(
    batch: int,
    k: int,
    uniforms: torch.Tensor | None,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:  # [B, K+1]
    """U_1..U_{K+1}: the given ones, and what they lack from `draw_uniforms(generators)`."""
    gens = generators if generators is not None else (None,) * batch
    if uniforms is None:
        return draw_uniforms(gens, k + 1, device)
    if uniforms.shape[1] == k:
        return torch.cat([uniforms, draw_uniforms(gens, 1, uniforms.device)], dim=1)
    return uniforms


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
