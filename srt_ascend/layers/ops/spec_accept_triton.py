"""Chain acceptance in Triton (contract in `spec_accept`): one program per request row.

The rejection kernel walks the K drafts, then makes three passes over the vocabulary at the
final position: the residual's mass (and p_t's, for the fallback), the CDF's total, and the
first token whose CDF reaches U_{K+1} * total. Passes two and three accumulate the CDF block by
block in the same order, so the total is exactly the last CDF value, as in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt_ascend.layers.ops import full_limits

# torch.finfo(torch.float32).tiny. A constexpr: a jitted function may read a module global only
# when it is one (Triton refuses a plain float at compile time; the interpreter accepted it, so
# sampled MTP aborted every request on CUDA while the CPU tests passed).
TINY = tl.constexpr(1.1754943508222875e-38)


# Token and length arguments are read as scalars and may be views at any offset: their
# pointers' alignment is not specialised, and the draft count K is a plain argument (loops
# over it are `while` loops), so neither a batch's layout nor adaptive K picks a variant.
@triton.jit(
    do_not_specialize=["K"],
    do_not_specialize_on_alignment=[
        "draft_ptr", "target_ptr", "limit_ptr", "accept_ptr", "emitted_ptr"
    ],
)  # fmt: skip
def _greedy_kernel(draft_ptr, target_ptr, limit_ptr, accept_ptr, emitted_ptr, K):
    b = tl.program_id(0)
    limit = tl.load(limit_ptr + b).to(tl.int32)  # k_r: drafts past it are never accepted
    accept = 0
    run = 1
    i = 0
    while i < limit:
        d = tl.load(draft_ptr + b * K + i)
        t = tl.load(target_ptr + b * (K + 1) + i)
        run = run * (d == t).to(tl.int32)
        accept += run
        i += 1
    tl.store(accept_ptr + b, accept.to(tl.int64))
    j = 0
    while j <= K:
        t = tl.load(target_ptr + b * (K + 1) + j).to(tl.int64)
        tl.store(emitted_ptr + b * (K + 1) + j, tl.where(j <= accept, t, -1))
        j += 1


@triton.jit
def _final_value(tp_row, dp_row, offs, vocab, has_draft, mass, pt_sum):
    # The final distribution's values at `offs`: normalise(max(p_t - p_d, 0)), or p_t / sum.
    valid = offs < vocab
    pt = tl.load(tp_row + offs, mask=valid, other=0.0).to(tl.float32)
    pd = tl.load(dp_row + offs, mask=valid & has_draft, other=0.0).to(tl.float32)
    residual = tl.maximum(pt - pd, 0.0)
    normalised = tl.math.div_rn(residual, tl.maximum(mass, TINY))
    fallback = tl.math.div_rn(pt, pt_sum)
    return tl.where(valid, tl.where(mass > 0, normalised, fallback), 0.0)


@triton.jit(
    do_not_specialize=["K", "stride_db", "stride_tb"],
    do_not_specialize_on_alignment=["draft_ptr", "u_ptr", "limit_ptr", "accept_ptr", "emitted_ptr"],
)
def _rejection_kernel(
    draft_ptr, dprobs_ptr, tprobs_ptr, u_ptr, limit_ptr, accept_ptr, emitted_ptr, vocab,
    stride_db, stride_dk, stride_tb, stride_tk, K,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    limit = tl.load(limit_ptr + b).to(tl.int32)  # k_r: drafts past it are never accepted
    accept = 0
    run = 1
    i = 0
    while i < limit:
        d = tl.load(draft_ptr + b * K + i).to(tl.int64)
        p_t = tl.load(tprobs_ptr + b * stride_tb + i * stride_tk + d).to(tl.float32)
        p_d = tl.load(dprobs_ptr + b * stride_db + i * stride_dk + d).to(tl.float32)
        u = tl.load(u_ptr + b * (K + 1) + i).to(tl.float32)
        run = run * ((p_t > 0) & (u * p_d <= p_t)).to(tl.int32)
        accept += run
        i += 1
    has_draft = accept < limit  # the bonus position has no draft distribution
    tp_row = tprobs_ptr + b * stride_tb + accept * stride_tk
    dp_row = dprobs_ptr + b * stride_db + tl.minimum(accept, K - 1) * stride_dk

    mass = tl.zeros([BLOCK_V], tl.float32)
    pt_sum = tl.zeros([BLOCK_V], tl.float32)
    v0 = 0
    while v0 < vocab:
        offs = v0 + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        pt = tl.load(tp_row + offs, mask=valid, other=0.0).to(tl.float32)
        pd = tl.load(dp_row + offs, mask=valid & has_draft, other=0.0).to(tl.float32)
        mass += tl.maximum(pt - pd, 0.0)
        pt_sum += pt
        v0 += BLOCK_V
    mass_total = tl.sum(mass, 0)
    pt_total = tl.sum(pt_sum, 0)

    total = 0.0
    v0 = 0
    while v0 < vocab:
        offs = v0 + tl.arange(0, BLOCK_V)
        values = _final_value(tp_row, dp_row, offs, vocab, has_draft, mass_total, pt_total)
        total += tl.sum(values, 0)
        v0 += BLOCK_V
    threshold = tl.load(u_ptr + b * (K + 1) + limit).to(tl.float32) * total  # U_{k_r+1}

    token = vocab - 1  # searchsorted past the end, clamped to the last token
    carry = 0.0
    v0 = 0
    while v0 < vocab:
        offs = v0 + tl.arange(0, BLOCK_V)
        values = _final_value(tp_row, dp_row, offs, vocab, has_draft, mass_total, pt_total)
        cdf = carry + tl.cumsum(values, 0)
        hit = (cdf >= threshold) & (offs < vocab)
        token = tl.minimum(token, tl.min(tl.where(hit, offs, vocab - 1), 0))
        carry += tl.sum(values, 0)
        v0 += BLOCK_V
    tl.store(accept_ptr + b, accept.to(tl.int64))
    j = 0
    while j <= K:
        d = tl.load(draft_ptr + b * K + j, mask=j < K, other=-1).to(tl.int64)
        out = tl.where(j < accept, d, tl.where(j == accept, token.to(tl.int64), -1))
        tl.store(emitted_ptr + b * (K + 1) + j, out)
        j += 1


def greedy_accept(draft_tokens, target_argmax, limits=None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_tokens.shape
    draft_tokens = draft_tokens.contiguous()
    target_argmax = target_argmax.contiguous()
    limits = full_limits(limits, batch, k, draft_tokens.device).contiguous()
    accept_len = torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)
    emitted = torch.empty(batch, k + 1, dtype=torch.int64, device=draft_tokens.device)
    if batch:
        _greedy_kernel[(batch,)](draft_tokens, target_argmax, limits, accept_len, emitted, K=k)
    return accept_len, emitted


def rejection_sample(
    draft_tokens, draft_probs, target_probs, uniforms, limits=None
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if uniforms.shape != (batch, k + 1):
        raise ValueError(f"uniforms must be [B, K+1] = [{batch}, {k + 1}], got {uniforms.shape}")
    if k == 0:  # no draft rows to point at: give the kernel a dummy [B, 1, V] of zeros
        draft_probs = target_probs.new_zeros(batch, 1, vocab)
    draft_tokens = draft_tokens.contiguous()
    draft_probs = draft_probs.contiguous()
    target_probs = target_probs.contiguous()
    uniforms = uniforms.contiguous()
    limits = full_limits(limits, batch, k, draft_tokens.device).contiguous()
    accept_len = torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)
    emitted = torch.empty(batch, k + 1, dtype=torch.int64, device=draft_tokens.device)
    if batch:
        _rejection_kernel[(batch,)](
            draft_tokens, draft_probs, target_probs, uniforms, limits, accept_len, emitted, vocab,
            draft_probs.stride(0), draft_probs.stride(1),
            target_probs.stride(0), target_probs.stride(1),
            K=k, BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
        )  # fmt: skip
    return accept_len, emitted
