"""Turns rows of logits into next tokens for a list of requests: penalties, min-new-tokens
masking, grammar masks, sampling with per-request settings, and the logprobs SGLang reports.

The one place below both decoders (plain and speculative): the target logits of a verify
position and the logits of a plain decode step go through the same `penalised_logits`, and
every logprob comes from `layers.sampler.token_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from srt_ascend.constrained import Grammar, apply_token_bitmask, fill_grammar_bitmask
from srt_ascend.layers.sampler import Sampler, TopLogprobs, token_logprobs
from srt_ascend.sampling.penalties import apply_logit_bias, apply_penalties, mask_stop_tokens
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams

_sampler = Sampler()


class SamplingRequest(Protocol):
    """What sampling reads of a request (the scheduler's Req has these)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    return_logprob: bool
    top_logprobs_num: int
    grammar: Grammar | None  # advanced over output_ids


@dataclass
class SampledRows:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top_logprobs: list[TopLogprobs] | None


def penalised_logits(
    logits: torch.Tensor,  # [B, V] float32
    reqs: Sequence[SamplingRequest],
    info: SamplingBatchInfo,
    eos_ids: list[int],
    extra: Sequence[Sequence[int]] | None = None,  # tokens each row generated past output_ids
    grammar: bool = True,  # False: the caller applies the grammar masks (verify_logits)
) -> torch.Tensor:
    """Applies repetition/frequency/presence penalties, logit biases, the min_new_tokens stop
    mask, and each grammar's token mask (the grammar's state after output_ids + extra). A
    grammar decides itself when its output may end: its request gets no min_new_tokens stop
    mask."""
    extra = extra or [[] for _ in reqs]
    vocab = logits.shape[-1]
    if info.need_penalties:
        counts = torch.zeros(len(reqs), vocab, dtype=torch.int64, device=logits.device)
        prompt = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=logits.device)
        for i, (r, more) in enumerate(zip(reqs, extra)):
            out = torch.tensor(r.output_ids + list(more), dtype=torch.int64, device=logits.device)
            counts[i].index_add_(0, out, torch.ones_like(out))
            prompt[i, torch.tensor(r.origin_input_ids, device=logits.device)] = True
        logits = apply_penalties(logits, info, counts, prompt)
    biased = [i for i, r in enumerate(reqs) if r.sampling_params.logit_bias]
    if biased:
        biases = [reqs[i].sampling_params.logit_bias for i in biased]
        logits = apply_logit_bias(logits, biased, biases)
    rows, stops = [], []
    for i, (r, more) in enumerate(zip(reqs, extra)):
        p = r.sampling_params
        if len(r.output_ids) + len(more) < p.min_new_tokens and r.grammar is None:
            rows.append(i)
            stops.append(sorted(set(eos_ids) | set(p.stop_token_ids or [])))
    if rows:
        logits = mask_stop_tokens(logits, rows, stops)
    bitmask = fill_grammar_bitmask([r.grammar for r in reqs], extra, vocab) if grammar else None
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    return logits


def verify_logits(
    logits: torch.Tensor,  # [B, K+1, V] target logits after t_{L-1}, d_1, ..., d_K
    reqs: Sequence[SamplingRequest],
    info: SamplingBatchInfo,
    eos_ids: list[int],
    drafts: Sequence[Sequence[int]],  # [B][K] each request's draft tokens
) -> torch.Tensor:  # [B, K+1, V]
    """`penalised_logits` at every verify position j, as if d_1..d_j had been generated; the
    grammar masks of all positions are filled and applied at once."""
    k1 = logits.shape[1]
    out = torch.stack(
        [
            penalised_logits(logits[:, j], reqs, info, eos_ids, [d[:j] for d in drafts], False)
            for j in range(k1)
        ],
        dim=1,
    )
    bitmask = fill_grammar_bitmask(
        [r.grammar for r in reqs for _ in range(k1)],
        [d[:j] for d in drafts for j in range(k1)],
        logits.shape[-1],
    )
    if bitmask is None:
        return out
    return apply_token_bitmask(out.view(-1, out.shape[-1]), bitmask).view(out.shape)


def all_plain_greedy(reqs: Sequence[SamplingRequest]) -> bool:
    """Every request decodes by argmax with nothing to apply to its logits: no penalties, no
    logit bias, no grammar, and min_new_tokens already reached (so no stop mask, now or for
    later draft positions). Such batches skip the sampling-settings tensors (argmax of the raw
    logits is the same rule)."""
    for r in reqs:
        p = r.sampling_params
        if not p.is_greedy or len(r.output_ids) < p.min_new_tokens or r.grammar is not None:
            return False
        if p.logit_bias:
            return False
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
            return False
    return True


def top_logprobs_nums(reqs: Sequence[SamplingRequest]) -> list[int]:
    return [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]


def sample_rows(
    logits: torch.Tensor,  # [B, V] float32, one row per request
    reqs: Sequence[SamplingRequest],
    vocab_size: int,
    eos_ids: list[int],
) -> SampledRows:
    if all_plain_greedy(reqs) and not any(r.return_logprob for r in reqs):
        return SampledRows(logits[:, :vocab_size].argmax(dim=-1).tolist(), None, None)
    info = SamplingBatchInfo.from_params(
        [r.sampling_params for r in reqs],
        vocab_size,
        logits.device,
        seed_offsets=[len(r.output_ids) for r in reqs],
    )
    logits = penalised_logits(logits[:, :vocab_size], reqs, info, eos_ids)
    want_lp = any(r.return_logprob for r in reqs)
    out = _sampler(logits, info, return_logprob=want_lp, top_logprobs_nums=top_logprobs_nums(reqs))
    return SampledRows(out.next_token_ids.tolist(), out.logprobs, out.top_logprobs)


def input_logprobs(
    logits: torch.Tensor,  # [N, V] logits at consecutive positions a..a+N-1
    next_tokens: list[int],  # [N] the token at position p+1 for each of them
    top_k: int,
) -> tuple[list[float], list[TopLogprobs]]:
    """Prompt logprobs: logprob of token p+1 under the logits at p (SGLang's semantics)."""
    ids = torch.tensor(next_tokens, dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, ids, [top_k] * len(next_tokens))
