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
from srt_ascend.layers.sampler import Sampler, TokenLogprobs, token_logprobs
from srt_ascend.sampling.penalties import apply_logit_bias, apply_penalties, mask_stop_tokens
from srt_ascend.sampling.penalty_state import PenaltyState, has_penalties, penalty_tensors
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.utils import HOST_READS, to_device

_sampler = Sampler()


class SamplingRequest(Protocol):
    """What sampling reads of a request (the scheduler's Req has these)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    return_logprob: bool
    top_logprobs_num: int
    token_ids_logprob: list[int] | None  # token ids whose logprobs are reported each step
    grammar: Grammar | None  # advanced over output_ids
    penalty_state: PenaltyState | None  # owned by sampling.penalty_state


@dataclass
class SampledRows:
    token_ids: list[int]
    logprobs: TokenLogprobs | None  # when a row asked for them


def penalised_logits(
    logits: torch.Tensor,  # [B, V] float32
    reqs: Sequence[SamplingRequest],
    info: SamplingBatchInfo,
    eos_ids: list[int],
    extra: torch.Tensor | None = None,  # [B, j] tokens each row generated past output_ids
    grammar: bool = True,  # False: the caller applies the grammar masks (verify_logits)
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,  # penalty_tensors(reqs), if made
    generated: Sequence[int] | None = None,  # tokens each row generated (`generated_counts`)
) -> torch.Tensor:
    """Applies repetition/frequency/presence penalties, logit biases, the min_new_tokens stop
    mask, and each grammar's token mask (the grammar's state after output_ids + extra). A
    grammar decides itself when its output may end: its request gets no min_new_tokens stop
    mask. `extra` (a speculative row's drafts before it) stays on the device; only grammar
    rows need it on the host (one read). Penalties read the requests' incremental token
    statistics (`penalty_tensors`, updating them; `stats` when the caller has them)."""
    generated = generated_counts(reqs, generated)
    n_extra = 0 if extra is None else extra.shape[1]
    vocab, device = logits.shape[-1], logits.device
    if info.need_penalties:
        counts, prompt = stats or penalty_tensors(reqs, vocab, device)
        if n_extra:  # out of place: the requests' states are rows of `counts`
            counts = counts.scatter_add(1, extra, torch.ones_like(extra, dtype=counts.dtype))
        logits = apply_penalties(logits, info, counts, prompt)
    biased = [i for i, r in enumerate(reqs) if r.sampling_params.logit_bias]
    if biased:
        biases = [reqs[i].sampling_params.logit_bias for i in biased]
        logits = apply_logit_bias(logits, biased, biases)
    rows, stops = [], []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if generated[i] + n_extra < p.min_new_tokens and r.grammar is None:
            rows.append(i)
            stops.append(min_new_stop_ids(r, eos_ids, vocab))
    if rows:
        logits = mask_stop_tokens(logits, rows, stops)
    if grammar and any(r.grammar is not None for r in reqs):
        ahead = HOST_READS.read(extra) if n_extra else [[] for _ in reqs]
        bitmask = fill_grammar_bitmask([r.grammar for r in reqs], ahead, vocab)
        logits = apply_token_bitmask(logits, bitmask)
    return logits


def min_new_stop_ids(req: SamplingRequest, eos_ids: list[int], vocab: int) -> list[int]:
    """The tokens a request below its min_new_tokens may not emit: the stop tokens (EOS and
    its stop_token_ids) inside the vocabulary (out-of-vocabulary ids never match)."""
    ids = set(eos_ids) | set(req.sampling_params.stop_token_ids or [])
    return sorted(t for t in ids if 0 <= t < vocab)


def verify_logits(
    logits: torch.Tensor,  # [B, K+1, V] target logits after t_{L-1}, d_1, ..., d_K
    reqs: Sequence[SamplingRequest],
    info: SamplingBatchInfo,
    eos_ids: list[int],
    drafts: torch.Tensor,  # [B, K] each request's draft tokens, on the device
) -> torch.Tensor:  # [B, K+1, V]
    """`penalised_logits` at every verify position j, as if d_1..d_j had been generated; the
    grammar masks of all positions are filled (one read of the drafts) and applied at once."""
    k1, vocab = logits.shape[1], logits.shape[-1]
    stats = penalty_tensors(reqs, vocab, logits.device) if info.need_penalties else None
    out = torch.stack(
        [
            penalised_logits(logits[:, j], reqs, info, eos_ids, drafts[:, :j], False, stats)
            for j in range(k1)
        ],
        dim=1,
    )
    if all(r.grammar is None for r in reqs):
        return out
    host = HOST_READS.read(drafts)
    bitmask = fill_grammar_bitmask(
        [r.grammar for r in reqs for _ in range(k1)],
        [d[:j] for d in host for j in range(k1)],
        logits.shape[-1],
    )
    return apply_token_bitmask(out.view(-1, out.shape[-1]), bitmask).view(out.shape)


def generated_counts(
    reqs: Sequence[SamplingRequest], generated: Sequence[int] | None = None
) -> Sequence[int]:
    """Tokens each request has generated: `generated` when the caller counted them (the
    overlap scheduler samples a step while the previous step's token is not committed yet, in
    another thread: it counts at launch and the sampling never reads `output_ids`), else the
    committed ones."""
    return [len(r.output_ids) for r in reqs] if generated is None else generated


def raw_logits(reqs: Sequence[SamplingRequest], generated: Sequence[int] | None = None) -> bool:
    """Nothing applies to any request's logits: no penalties, no logit bias, no grammar, and
    min_new_tokens already reached (so no stop mask, now or for later draft positions)."""
    for r, n in zip(reqs, generated_counts(reqs, generated)):
        p = r.sampling_params
        if n < p.min_new_tokens or r.grammar is not None or p.logit_bias or has_penalties(p):
            return False
    return True


def all_plain_greedy(
    reqs: Sequence[SamplingRequest], generated: Sequence[int] | None = None
) -> bool:
    """Every request decodes by argmax of its `raw_logits`. Such batches skip the
    sampling-settings tensors (argmax of the raw logits is the same rule)."""
    return all(r.sampling_params.is_greedy for r in reqs) and raw_logits(reqs, generated)


def greedy_tokens(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T] int64: each row's argmax over the first `vocab_size` columns of `logits` [T, V]
    (columns past the tokenizer's vocabulary are padding): greedy sampling's rule, the one op
    `sample_tokens` and a graph ending with the argmax (GraphKind.argmax_vocab) both run, so
    both give the same tokens."""
    return logits[:, :vocab_size].argmax(dim=-1)


def greedy_without_logprobs(
    reqs: Sequence[SamplingRequest], generated: Sequence[int] | None = None
) -> bool:
    """`all_plain_greedy` and no request wants logprobs: the batch's tokens are the argmax
    of its raw logits and nothing else is read of them (so a graph may end with that argmax,
    GraphKind.argmax_vocab)."""
    return all_plain_greedy(reqs, generated) and not any(r.return_logprob for r in reqs)


def top_logprobs_nums(reqs: Sequence[SamplingRequest]) -> list[int]:
    return [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]


def ids_wanted(reqs: Sequence[SamplingRequest]) -> list[list[int]]:
    return [(r.token_ids_logprob or []) if r.return_logprob else [] for r in reqs]


@dataclass
class SampledTokens:
    token_ids: torch.Tensor  # [B] int64, on the device
    logprobs: TokenLogprobs | None  # when a row asked for them (read to the host)


def sample_tokens(
    logits: torch.Tensor,  # [B, V] float32, one row per request
    reqs: Sequence[SamplingRequest],
    vocab_size: int,
    eos_ids: list[int],
    generated: Sequence[int] | None = None,  # tokens each row generated (`generated_counts`)
) -> SampledTokens:
    """One token per row, left on the device (the logprobs, when asked, are read)."""
    generated = generated_counts(reqs, generated)
    if greedy_without_logprobs(reqs, generated):
        return SampledTokens(greedy_tokens(logits, vocab_size), None)
    info = SamplingBatchInfo.from_params(
        [r.sampling_params for r in reqs],
        vocab_size,
        logits.device,
        seed_offsets=list(generated),
    )
    logits = penalised_logits(logits[:, :vocab_size], reqs, info, eos_ids, generated=generated)
    want_lp = any(r.return_logprob for r in reqs)
    out = _sampler(
        logits,
        info,
        return_logprob=want_lp,
        top_logprobs_nums=top_logprobs_nums(reqs),
        ids_wanted=ids_wanted(reqs),
    )
    return SampledTokens(out.next_token_ids, out.logprobs)


def sample_rows(
    logits: torch.Tensor,  # [B, V] float32, one row per request
    reqs: Sequence[SamplingRequest],
    vocab_size: int,
    eos_ids: list[int],
) -> SampledRows:
    """`sample_tokens`, the tokens read to the host."""
    res = sample_tokens(logits, reqs, vocab_size, eos_ids)
    return SampledRows(HOST_READS.read(res.token_ids), res.logprobs)


def input_logprobs(
    logits: torch.Tensor,  # [N, V] logits at consecutive positions a..a+N-1
    next_tokens: list[int],  # [N] the token at position p+1 for each of them
    top_k: int,
    asked: list[int] | None = None,  # token_ids_logprob
) -> TokenLogprobs:
    """Prompt logprobs: logprob of token p+1 under the logits at p (SGLang's semantics)."""
    ids = to_device(next_tokens, logits.device)
    n = len(next_tokens)
    return token_logprobs(logits, ids, [top_k] * n, [asked or []] * n)
