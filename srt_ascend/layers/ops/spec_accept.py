"""Chain speculative acceptance: greedy and rejection sampling in one op, reference + dispatch.

`speculative/acceptance.py` runs its greedy and token-wise rules through this op (block
verification stays torch there). Both return (accept_len [B] int64, emitted [B, K+1] int64):
`accept_len` counts accepted drafts (0..K); emitted[b, :accept_len+1] are the accepted drafts
followed by one target token (the correction at the first rejection, or the bonus after all
K), then -1.

Per-request limits k_r [B] (0..K; None: K for every row) make row r the step a K = k_r round
would run over the same drafts and uniforms: drafts past k_r are never accepted, and with all
k_r accepted the bonus comes from p_t[k_r] at U_{k_r+1} (`uniforms[:, k_r]`).

Greedy: accept the longest draft prefix (at most k_r) with d_i == target_argmax[i-1]; emit
target_argmax[:accept_len+1].

Rejection sampling, with explicit uniforms U [B, K+1] in (0, 1]: accept d_i (i <= k_r) iff
p_t(d_i) > 0 and U_i * p_d(d_i) <= p_t(d_i) (float32), for the leading run of accepts. At
position a = accept_len, draw the final token by inverting the CDF at U_{k_r+1} of
normalise(max(p_t[a] - p_d[a], 0)) (p_t[a] itself when that is all zero, and for the bonus
a == k_r, where p_d is taken as 0).

Equality with the torch rule: accept_len and the greedy path are exact (the same float32
comparisons). The final draw sums float32 probabilities in another order than torch's
reductions, so its CDF can differ from torch's by float rounding; the token differs only if
U_{K+1} * total lands within that rounding of a CDF step (about 1e-7 of draws).
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops import full_limits, pick, triton_available
from srt_ascend.layers.sampler import inverse_cdf_sample


def greedy_accept_reference(
    draft_tokens: torch.Tensor,  # [B, K]
    target_argmax: torch.Tensor,  # [B, K+1]
    limits: torch.Tensor | None = None,  # [B] int64 k_r in 0..K
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_tokens.shape
    limit = full_limits(limits, batch, k, draft_tokens.device).view(-1, 1)
    within = torch.arange(k, device=draft_tokens.device).view(1, -1) < limit
    matches = (draft_tokens == target_argmax[:, :k]) & within
    accept_len = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    positions = torch.arange(k + 1, device=draft_tokens.device).view(1, -1)
    emitted = torch.where(positions <= accept_len.view(-1, 1), target_argmax, -1)
    return accept_len, emitted.to(torch.int64)


def rejection_sample_reference(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniforms: torch.Tensor,  # [B, K+1] in (0, 1]
    limits: torch.Tensor | None = None,  # [B] int64 k_r in 0..K
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_tokens.shape
    limit = full_limits(limits, batch, k, draft_tokens.device)
    draft_tokens = draft_tokens.to(torch.int64)
    index = draft_tokens.unsqueeze(-1)
    p_t = target_probs[:, :k].to(torch.float32).gather(-1, index).squeeze(-1)  # [B, K]
    p_d = draft_probs.to(torch.float32).gather(-1, index).squeeze(-1)  # [B, K]
    within = torch.arange(k, device=draft_tokens.device).view(1, -1) < limit.view(-1, 1)
    accepted = within & (p_t > 0) & (uniforms[:, :k].to(torch.float32) * p_d <= p_t)
    accept_len = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    # Position a = accept_len: recovered(p_t[a], p_d[a]), with p_d = 0 for the bonus a == k_r.
    vocab = target_probs.shape[-1]
    at = accept_len.view(batch, 1, 1).expand(batch, 1, vocab)
    final_t = target_probs.gather(1, at).squeeze(1).to(torch.float32)  # [B, V]
    if k == 0:
        final_d = torch.zeros_like(final_t)
    else:
        final_d = draft_probs.gather(1, at.clamp(max=k - 1)).squeeze(1)
        final_d = final_d * (accept_len < limit).view(batch, 1).to(final_d.dtype)
    residual = (final_t - final_d.to(torch.float32)).clamp_(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    normalised = residual / mass.clamp(min=torch.finfo(torch.float32).tiny)
    fallback = final_t / final_t.sum(dim=-1, keepdim=True)
    final_u = uniforms.gather(1, limit.view(-1, 1)).squeeze(1)  # U_{k_r+1}
    final_token = inverse_cdf_sample(torch.where(mass > 0, normalised, fallback), final_u)
    # emitted[j] = d_{j+1} for j < accept_len, the final token at j == accept_len, -1 after.
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    positions = torch.arange(k + 1, device=draft_tokens.device).view(1, -1)
    a = accept_len.view(-1, 1)
    emitted = torch.where(positions < a, padded, -1)
    return accept_len, torch.where(positions == a, final_token.view(-1, 1), emitted)


def _load_greedy():
    from srt_ascend.layers.ops import spec_accept_triton

    return spec_accept_triton.greedy_accept


def _load_rejection():
    from srt_ascend.layers.ops import spec_accept_triton

    return spec_accept_triton.rejection_sample


# device type -> loader; NPU uses Triton-Ascend when it is installed (torch_npu has no fused op)
_GREEDY_IMPLS = {"cuda": _load_greedy}
_REJECTION_IMPLS = {"cuda": _load_rejection}
if triton_available():
    _GREEDY_IMPLS["npu"] = _load_greedy
    _REJECTION_IMPLS["npu"] = _load_rejection


def greedy_accept(draft_tokens, target_argmax, limits=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatches by the drafts' device (contract in the module docstring)."""
    fn = pick(_GREEDY_IMPLS, draft_tokens.device, greedy_accept_reference)
    return fn(draft_tokens, target_argmax, limits)


def rejection_sample(
    draft_tokens, draft_probs, target_probs, uniforms, limits=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatches by the drafts' device (contract in the module docstring)."""
    fn = pick(_REJECTION_IMPLS, draft_tokens.device, rejection_sample_reference)
    return fn(draft_tokens, draft_probs, target_probs, uniforms, limits)
