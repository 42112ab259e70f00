"""MTP draft worker: drafts K tokens per request with the DeepSeek-V3 MTP module.

The worker holds narrow handles only: the MTP forward (eager or a graph replay) and its LM head,
a ForwardBatch builder over the shared paged pool (the MTP layers are extra layers of it) and
the request-to-token table. The decoder owns allocation and commits.

Per request it keeps a SpecState (Req.decoder_state) between steps: the first draft d_1, the
processed distribution it was sampled from, and the module's output hidden that feeds the
next application. Drafts never leave the device: the verify forward reads them as input ids
and the acceptance rule compares them there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from srt_ascend.decoding.base import StepRequest
from srt_ascend.layers.sampler import processed_probs, sample_from_probs, uniforms_among
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.sampling.penalties import mask_stop_tokens
from srt_ascend.sampling.sample_step import (
    all_plain_greedy,
    generated_counts,
    min_new_stop_ids,
    penalised_logits,
)
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo, seeded_generator
from srt_ascend.server_args import MAX_SPEC_STEPS
from srt_ascend.speculative.acceptance import AcceptResult
from srt_ascend.speculative.mtp_deferral import DeferralMixin
from srt_ascend.speculative.spec_state import state_of
from srt_ascend.speculative.verify import Ragged
from srt_ascend.utils import to_device

# Seeded requests draw their drafts from streams apart from their target samples (whose
# offsets are output lengths, >= 0): see `draft_seed_offset`.


def draft_seed_offset(start_len: int, j: int) -> int:
    """`mix_seed` offset of draft j (1..MAX_SPEC_STEPS) of the chain verified by the step
    that starts with `start_len` output tokens (d_1 is drafted at the end of the step before,
    after its commit, or by a catch-up at the start of this one: the same output length).

    Rule: every (start_len, j) has a stream of its own, and none is a target stream (those
    take offsets >= 0; these are negative). Steps start at strictly growing output lengths, so
    a stream whose draw went into one step's acceptance test (block verification reads every
    draft of a chain, not only those up to the first rejection) is never drawn again by a
    later step. A stream is redrawn only for the same step, e.g. after a retraction, which
    replays it (reproducible seeds)."""
    return -1 - (start_len * MAX_SPEC_STEPS + j - 1)


# (fb, h_t, draft step, graph kind or None) -> output hidden
MtpForward = Callable[[ForwardBatch, torch.Tensor, int, "GraphKind | None"], torch.Tensor]
# the same, and the rows (a device index tensor) whose logits are wanted
# -> (output hidden, logits of those rows [rows, V] float32): ModelRunner.forward_mtp_logits
MtpLogitsForward = Callable[
    [ForwardBatch, torch.Tensor, int, "GraphKind | None", torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class DraftHandles:
    forward: MtpForward
    forward_logits: MtpLogitsForward
    # (mode, ids, rows, seq, ext, loc[, backend, seq_bounds]): ModelRunner.build_forward_batch
    build_forward_batch: Callable[..., ForwardBatch]
    req_to_token: torch.Tensor  # [rows, max_context] slot table
    vocab_size: int
    eos_ids: list[int]
    # (fb, h_t, MTP layer): only the KV that layer's forward writes (ModelRunner.write_mtp_kv);
    # None: a pass without drafting runs the whole layers
    write_kv: Callable[[ForwardBatch, torch.Tensor, int], None] | None = None


class Drafts(NamedTuple):
    """One step's drafts, on the device."""

    tokens: torch.Tensor  # [B, K] d_1..d_K
    probs: torch.Tensor | None  # [B, K, V] what each was drawn from; None: all greedy


class FirstDrafts(NamedTuple):
    """Each request's d_1 for its next round, on the device: what `draft_after_verify` drew
    and an overlapped round hands to the next one (SpecState holds the same per request)."""

    tokens: torch.Tensor  # [B]
    probs: torch.Tensor | None  # [B, V]; None: every d_1 greedy
    hidden: torch.Tensor  # [B, D] the outputs that drafted them


class Starts(NamedTuple):
    """Each request's first position of a round (the position of its verify input token) on
    the device, with host upper bounds: an overlapped round's follow the previous round's
    accept lengths, which the host has not read. A round with exact host starts passes them
    as a list instead."""

    device: torch.Tensor  # [B] int64
    bounds: list[int]


class Counts(NamedTuple):
    """Tokens each request generated before a round, where the host knows them as a range
    only: a round launched before the round ahead of it is read starts at low[i] + extra[i]
    generated tokens, extra (that round's accept lengths) on the device, in 0..span-1. A
    seeded request's streams follow the count, so `stream_uniforms` draws every count's and
    picks on the device. A round with exact host counts passes them as a list instead;
    min_new_tokens and the rest read the lower bounds (`lower`): an overlapped round has
    none still ahead."""

    low: list[int]
    extra: torch.Tensor  # [B] int64
    span: int


def lower(generated: list[int] | Counts) -> list[int]:
    """The counts, or their host lower bounds."""
    return generated.low if isinstance(generated, Counts) else generated


def counts_after(generated: list[int] | Counts, accept_len: torch.Tensor, k1: int) -> Counts:
    """The counts once a round with up to `k1` tokens is committed: accept_len + 1 more."""
    if isinstance(generated, Counts):
        low, extra, span = generated
        return Counts([g + 1 for g in low], extra + accept_len, span + k1 - 1)
    return Counts([g + 1 for g in generated], accept_len, k1)


def stream_uniforms(
    reqs: list[StepRequest], generated: Counts, draft: int, num: int
) -> torch.Tensor:  # [B, num] in (0, 1]
    """The `num` uniforms each row draws from its stream at its count (`draft` 0: the
    target's, the verify's; j: draft j's, `draft_seed_offset`): a sampled seeded row's are
    the numbers a round with that exact count draws, drawn on the host for every count of
    its range (`stream_draws`) and picked on the device; the other rows' come from the
    global RNG (a greedy row's uniforms decide nothing)."""
    candidates = [
        None
        if (p := r.sampling_params).seed is None or p.is_greedy
        else stream_draws(r, draft, num, g, generated.span)
        for r, g in zip(reqs, generated.low)
    ]
    return uniforms_among(candidates, generated.extra, num)


def stream_draws(req: StepRequest, draft: int, num: int, low: int, span: int) -> torch.Tensor:
    """[span, num] host draws of a seeded request's stream (`draft` as in `stream_uniforms`)
    at counts low .. low+span-1: `num` numbers from seeded_generator(seed, offset). Each
    count's are drawn once and kept in the request's SpecState (the range of an overlapped
    round overlaps the next one's); counts below `low` are dropped (counts only grow: a
    stream is never read again once its count is passed, and one drawn again is the same)."""
    kept = state_of(req).draws.setdefault((draft, num), {})
    # a snapshot of the counts, and pops that tolerate a miss: an overlapped round's sampled
    # graph draws on the scheduler's thread while the round before it may draw here on the
    # device worker's (a count dropped by one is drawn again, the same numbers)
    for c in [c for c in list(kept) if c < low]:
        kept.pop(c, None)
    seed, out = req.sampling_params.seed, []
    for c in range(low, low + span):
        drawn = kept.get(c)
        if drawn is None:
            offset = c if draft == 0 else draft_seed_offset(c, draft)
            drawn = kept[c] = torch.rand(num, generator=seeded_generator(seed, offset))
        out.append(drawn)
    return torch.stack(out)


def lengths(starts: list[int] | Starts, plus: int):
    """(sequence lengths start + plus, their host bounds or None when exact): the `seq_lens`
    and `seq_bounds` of a ForwardBatch over positions ending at start + plus - 1."""
    if isinstance(starts, Starts):
        return starts.device + plus, [b + plus for b in starts.bounds]
    return [s + plus for s in starts], None


def one_hot_probs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., V] float32: a greedy draft's distribution, one-hot at its token."""
    return nn.functional.one_hot(tokens, vocab).to(torch.float32)


class MTPWorker(DeferralMixin):
    def __init__(
        self,
        handles: DraftHandles,
        extend_kinds: dict[int, GraphKind],  # the pass after verifying K drafts: 1+K tokens
        step_kinds: dict[int, GraphKind],  # draft step j (1..K-1) (see `draft_chain`)
        layer_kinds: dict[tuple[int, int], GraphKind] | None = None,  # (K, layer > 0)
    ) -> None:
        """`layer_kinds`: for a checkpoint with several MTP layers, the pass of each later
        layer a draft step runs (layer > 0) after verifying K drafts; empty with one layer."""
        self.h = handles
        self.extend_kinds, self.step_kinds = extend_kinds, step_kinds
        self.prefill_kind = extend_kinds[max(extend_kinds)]
        self.layer_kinds = layer_kinds or {}
        self.later_layers = sorted({layer for _, layer in self.layer_kinds})
        # after a ragged verify, the MTP pass covers only the verified positions (its
        # batches then vary in shape: where they run eagerly, no graph replays them)
        self.ragged_pass = False

    def mtp_pass(
        self,
        build: Callable[[], ForwardBatch],
        hidden: torch.Tensor,
        kind: GraphKind | None,
        k: int,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer 0 over a DRAFT_EXTEND batch (its output drafts d_1), and every later MTP
        layer a draft step runs over the same inputs (h_p, token p+1), for their KV at these
        positions: each layer's attention reads its own KV layer. Returns layer 0's output
        and the logits of its `rows` (a device index tensor)."""
        out = self.h.forward_logits(build(), hidden, 0, kind, rows)
        for layer in self.later_layers:
            self.h.forward(build(), hidden, layer, self.layer_kinds[k, layer])
        return out

    @torch.inference_mode()
    def draft_extend(
        self,
        reqs: list[StepRequest],
        starts: list[int],  # first position of each request's new range
        lens: list[int],  # positions computed this pass
        hidden: torch.Tensor,  # [sum(lens), D] main-model hidden at those positions
        next_tokens: list[list[int]],  # token at p+1 for each position p (len = lens[i])
        draft_rows: list[bool],  # whose last position's output drafts d_1
    ) -> None:
        """DRAFT_EXTEND: MTP over (h_p, token p+1) at positions p, writing the MTP layer's KV
        into the same slots as the main model's; the last output drafts d_1. Where the
        handles can (`write_kv`), the positions no draft is read from (all but each drafting
        request's last) get only their KV, and the whole layers run over the drafting
        requests' last positions, whose attention reads that KV."""
        if self.h.write_kv is not None:
            picked = self._write_kv(reqs, starts, lens, hidden, next_tokens, draft_rows)
            if not picked:
                return
            reqs, starts, hidden, next_tokens = self._last_positions(
                picked, reqs, starts, lens, hidden, next_tokens
            )
            lens, draft_rows = [1] * len(reqs), [True] * len(reqs)
        build = self._extend_batch(reqs, starts, lens, next_tokens)
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        picked, last = self._drafting(reqs, ends, draft_rows, hidden.device)
        out, logits = self.mtp_pass(build, hidden, self.prefill_kind, max(self.extend_kinds), last)
        self._draft_first(picked, out[last], logits)

    def _extend_batch(
        self, reqs, starts: list[int], lens: list[int], next_tokens: list[list[int]]
    ) -> Callable[[], ForwardBatch]:
        """A builder of the DRAFT_EXTEND batch over positions starts[i] .. starts[i] +
        lens[i] - 1 of each request, its inputs the token after each position."""
        ids = [t for toks in next_tokens for t in toks]
        rows = [r.req_pool_idx for r in reqs]
        seq = [s + n for s, n in zip(starts, lens)]
        loc = torch.cat(
            [self.h.req_to_token[r.req_pool_idx, s : s + n] for r, s, n in zip(reqs, starts, lens)]
        )
        return lambda: self.h.build_forward_batch(
            ForwardMode.DRAFT_EXTEND, ids, rows, seq, lens, loc
        )

    @torch.inference_mode()
    def draft_after_verify(
        self,
        reqs: list[StepRequest],
        starts: list[int] | Starts,  # position of each request's verify input token
        loc: torch.Tensor,  # [B, K+1] slots of positions start .. start+K
        hidden: torch.Tensor,  # [B*(K+1), D] the verify forward's target hidden states
        verdict: AcceptResult,  # accept_len [B], emitted [B, K+1] (-1 past them), on the device
        generated: list[int] | Counts | None,  # tokens each request generated before the round
        draft_rows: list[bool] | None = None,  # whose d_1 is drafted (None: every row's)
        rows: list[int] | None = None,  # req_to_token rows (None: the requests' own)
        ragged: Ragged | None = None,  # a ragged verify's rows: `hidden` is [R, D]
    ) -> FirstDrafts | None:
        """DRAFT_EXTEND after a verify, always over all 1+K positions per request (a fixed
        shape a graph can replay): the token after position start+j is emitted[j] (0 past
        the accepted ones). Rows past a request's committed positions see only their own
        prefix causally and write MTP KV into rejected slots, which are freed afterwards (a
        request stopped inside its accepted tokens has its KV up to the stop, keyed as the
        committed tokens key it). The output at row accept_len drafts the next d_1.

        With `generated` the round is not committed yet (read): nothing here needs a host
        value of it, and d_1 is drawn as after the commit (`_draft_ahead`); the batch has no
        penalties nor grammar, whose state the commit advances. None: it is committed, and
        d_1 follows the requests' host state. Returns the drafted d_1 (every row's) with
        `generated`, else None; each drafting request's SpecState keeps its own. After a
        ragged verify (`ragged`) the pass's rows are `_pass_rows`'."""
        batch, k1 = len(reqs), loc.shape[1]
        next_tokens = verdict.emitted.clamp(min=0)  # [B, K+1]
        per, seq, bounds, next_tokens, slots, hidden, first = self._pass_rows(
            starts, ragged, next_tokens, loc, hidden
        )
        build = lambda: self.h.build_forward_batch(  # noqa: E731
            ForwardMode.DRAFT_EXTEND,
            next_tokens,
            rows or [r.req_pool_idx for r in reqs],
            seq,
            per,
            slots,
            None,
            bounds,
        )
        ends = first + verdict.accept_len
        chosen = [i for i in range(batch) if draft_rows is None or draft_rows[i]]
        if len(chosen) < batch:
            ends = ends.index_select(0, to_device(chosen, loc.device))
        out, logits = self.mtp_pass(build, hidden, self.extend_kinds[k1 - 1], k1 - 1, ends)
        picked = [reqs[i] for i in chosen]
        if generated is None:
            self._draft_first(picked, out[ends], logits)
            return None
        # every row drafts (draft_rows is None with `generated`)
        tokens, probs = self._draft_ahead(picked, logits, generated, verdict.accept_len, k1)
        first = FirstDrafts(tokens, probs, out[ends])
        self.keep_first(picked, *first)
        return first

    def _pass_rows(self, starts, ragged: Ragged | None, tokens, loc, hidden):
        """The MTP pass's rows after a verify over `loc` [B, K+1]: (positions per request,
        sequence lengths, their host bounds, next tokens, slots, target hidden, each
        request's first row). Every request's 1 + K positions (a fixed shape a graph can
        replay; after a ragged verify its hidden rows spread back, row k_r repeated), or after
        a ragged verify with exact host starts, where the pass runs eagerly (`ragged_pass`),
        its 1 + k_r verified positions only (the rows past k_r are never accepted)."""
        batch, k1 = loc.shape
        seq, bounds = lengths(starts, k1)
        tokens, loc = tokens.reshape(-1), loc.reshape(-1)
        if ragged is not None and self.ragged_pass and not isinstance(starts, Starts):
            per = [n + 1 for n in ragged.limits]
            seq = [s + n for s, n in zip(starts, per)]
            return per, seq, bounds, ragged.take(tokens), ragged.take(loc), hidden, ragged.first
        if ragged is not None:
            hidden = ragged.spread(hidden)
        first = torch.arange(0, batch * k1, k1, device=loc.device)
        return [k1] * batch, seq, bounds, tokens, loc, hidden, first

    @staticmethod
    def _drafting(reqs, last_rows: list[int], draft_rows: list[bool], device):
        """The requests that draft d_1 now, and the output rows (their last positions, a
        device index tensor) whose logits draft it."""
        chosen = [i for i, d in enumerate(draft_rows) if d]
        return [reqs[i] for i in chosen], to_device([last_rows[i] for i in chosen], device)

    def _draft_first(self, picked, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """d_1 of each `picked` request from its row of `logits` [B, V]; `hidden` [B, D]: the
        outputs that drafted it (the next draft step's input)."""
        if not picked:
            return
        self.keep_first(picked, *self._draft_step(picked, logits, None), hidden)

    @staticmethod
    def keep_first(picked, tokens: torch.Tensor, probs: torch.Tensor | None, hidden) -> None:
        """Each request's d_1 (`tokens` [B]), its distribution and drafting output, kept in
        its state for the next round."""
        for i, r in enumerate(picked):
            s = state_of(r)
            s.token, s.hidden = tokens[i], hidden[i]
            s.probs = None if probs is None else probs[i]

    @torch.inference_mode()
    def draft_chain(
        self,
        reqs: list[StepRequest],
        loc: torch.Tensor,
        first: FirstDrafts | None = None,
        starts: list[int] | Starts | None = None,
        rows: list[int] | None = None,
        generated: list[int] | Counts | None = None,
        limits: list[int] | None = None,
    ) -> Drafts:
        """d_1 from each request's state, then draft steps 2..K: MTP layer l_j (j = 1..K-1,
        `layer_for_step`) over (the chain's outputs, its drafts) at positions L-1 .. L-2+j
        (L = committed length; position L-2+i takes the output that drafted d_i, and d_i),
        writing MTP KV into the verify slots `loc` [B, K+1] allocated for positions
        L-1 .. L-1+K (overwritten after verify), K >= 1 (a K = 0 step is the plain
        decoder's). A step whose layer ran the step before needs only its last position (a
        1-token step; the layer's KV at the others holds the same inputs already); a step
        that starts a new layer runs all j positions (the first one: 1). Everything stays on
        the device. `first`: d_1 (an overlapped round's, from the round before; None: the
        requests' states); `starts`: L-1 per request (on the device in an overlapped round;
        None: from the committed lengths); `rows`: their req_to_token rows (None: the
        requests' own; an overlapped round takes them at launch, as a request released
        meanwhile has none); `generated`: the tokens each generated before the round, which
        its seeded draft streams follow (None: the committed ones); `limits`: each request's
        k_r, with host starts: step j then runs over the requests with k_r > j only (the
        others' drafts past k_r, never examined, repeat their last one)."""
        k = loc.shape[1] - 1
        first = self.first_of(reqs) if first is None else first
        tokens = [first.tokens]  # [B] per draft position
        probs = [first.probs]
        outs = [first.hidden]  # [B, D] the output drafting d_j
        rows = rows or [r.req_pool_idx for r in reqs]
        begin = starts if starts is not None else [r.seq_len - 1 for r in reqs]
        for j in range(1, k):
            keep = None if limits is None else [i for i, m in enumerate(limits) if m > j]
            if keep == []:  # nobody reads d_{j+1} .. d_K
                tokens += [tokens[-1]] * (k - j)
                probs += [None] * (k - j)
                break
            if keep is None or len(keep) == len(reqs):
                out, token, p = self._chain_step(j, reqs, tokens, outs, rows, begin, loc, generated)
            else:
                out, token, p = self._chain_step_of(
                    keep, j, reqs, tokens, outs, rows, begin, loc, generated
                )
            outs.append(out)
            tokens.append(token)
            probs.append(p)
        return self._stacked(tokens, probs)

    def _chain_step(self, j, reqs, tokens, outs, rows, begin, loc, generated):
        """Draft step j over these requests (`draft_chain`): (the outputs drafting d_{j+1}
        [B, D], d_{j+1} [B], its distribution [B, V] or None)."""
        kind = self.step_kinds[j]
        n = kind.tokens_per_req  # positions L-1-n+j .. L-2+j
        seq, bounds = lengths(begin, j)  # KV positions 0 .. L-2+j
        fb = self.h.build_forward_batch(
            ForwardMode.DECODE if n == 1 else ForwardMode.DRAFT_EXTEND,
            torch.stack(tokens[j - n :], dim=1).reshape(-1),
            rows,
            seq,
            [n] * len(reqs),
            loc[:, j - n : j].reshape(-1),
            None,
            bounds,
        )
        hidden = torch.stack(outs[j - n :], dim=1).reshape(-1, outs[0].shape[-1])
        last = torch.arange(n - 1, len(reqs) * n, n, device=loc.device)  # each one's last
        out, logits = self.h.forward_logits(fb, hidden, j, kind, last)
        out = out.view(len(reqs), n, -1)[:, -1]
        token, p = self._draft_step(reqs, logits, torch.stack(tokens, dim=1), generated)
        return out, token, p

    def _chain_step_of(self, keep, j, reqs, tokens, outs, rows, begin, loc, generated):
        """`_chain_step` over the requests `keep` (indices; host starts) only, laid out over
        the batch again: the others repeat their last draft and output (one-hot where the
        step's drafts have distributions)."""
        at = to_device(keep, loc.device)
        pick = lambda t: t.index_select(0, at)  # noqa: E731
        out, token, p = self._chain_step(
            j,
            [reqs[i] for i in keep],
            [pick(t) for t in tokens],
            [pick(o) for o in outs],
            [rows[i] for i in keep],
            [begin[i] for i in keep],
            pick(loc),
            None if generated is None else [generated[i] for i in keep],
        )
        token = tokens[-1].index_copy(0, at, token)
        if p is not None:
            p = one_hot_probs(token, self.h.vocab_size).index_copy(0, at, p)
        return outs[-1].index_copy(0, at, out), token, p

    def _stacked(self, tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> Drafts:
        """The chain's drafts [B, K] and their distributions [B, K, V]: None when every draft
        was greedy, else one-hot at the greedy ones."""
        drafts = torch.stack(tokens, dim=1)
        if all(p is None for p in probs):
            return Drafts(drafts, None)
        vocab = self.h.vocab_size
        one_hot = [one_hot_probs(t, vocab) if p is None else p for t, p in zip(tokens, probs)]
        return Drafts(drafts, torch.stack(one_hot, 1))

    def first_of(self, reqs: list[StepRequest]) -> FirstDrafts:
        """The requests' d_1 as their states keep them, stacked; the distributions are None
        when every d_1 was greedy, else one-hot for the greedy ones."""
        states = [state_of(r) for r in reqs]
        tokens = torch.stack([s.token for s in states])
        probs = None
        if any(s.probs is not None for s in states):
            one_hot = one_hot_probs(tokens, self.h.vocab_size)  # one op for the batch
            probs = torch.stack(
                [one_hot[i] if s.probs is None else s.probs for i, s in enumerate(states)]
            )
        return FirstDrafts(tokens, probs, torch.stack([s.hidden for s in states]))

    def _draft_step(
        self,
        reqs: list[StepRequest],
        logits: torch.Tensor,  # [B, V'] the MTP head's logits of each row's drafting output
        drafted: torch.Tensor | None,  # [B, j] drafts of this chain so far (None: j = 0)
        generated: list[int] | Counts | None = None,  # before the round (None: committed)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft of every row [B] and the distribution it came from [B, V] (None
        when every row drafts greedily), on the device. A seeded row draws from the stream
        `draft_seed_offset` of its count (on the device with `Counts`)."""
        logits = logits[:, : self.h.vocab_size]
        counts = generated_counts(reqs, None if generated is None else lower(generated))
        if all_plain_greedy(reqs, counts):
            return logits.argmax(dim=-1), None
        n_drafted = 0 if drafted is None else drafted.shape[1]  # the same for every row
        ranged = isinstance(generated, Counts)
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            self.h.vocab_size,
            logits.device,
            seed_offsets=None if ranged else [draft_seed_offset(c, n_drafted + 1) for c in counts],
            generators=not ranged,  # a range: `stream_uniforms` below
        )
        logits = penalised_logits(logits, reqs, info, self.h.eos_ids, drafted, generated=counts)
        if info.is_all_greedy:  # greedy verification needs the draft tokens only
            return logits.argmax(dim=-1), None
        probs = processed_probs(logits, info)  # [B, V]
        uniforms = None
        if ranged:
            uniforms = stream_uniforms(reqs, generated, n_drafted + 1, 1)[:, 0]
        return sample_from_probs(probs, info, uniforms), probs

    def _draft_ahead(
        self,
        reqs: list[StepRequest],
        logits: torch.Tensor,  # [B, V'] the MTP head's logits at each row's last accepted one
        generated: list[int] | Counts,  # [B] tokens each request generated before the round
        accept_len: torch.Tensor,  # [B] the round's accepted drafts, on the device
        k1: int,  # K+1: the most tokens the round commits
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_draft_step`'s d_1 for requests that will have generated generated[i] +
        accept_len[i] + 1 tokens once the round is committed, drawn before that count reaches
        the host: a row's min_new_tokens stop mask and its seeded stream
        (`draft_seed_offset`) are those of that count, chosen on the device. No penalties nor
        grammar (their state is the committed tokens'). With `Counts` (the round's own count
        is a range) the stop mask reads their lower bounds (no min_new_tokens is ahead)."""
        after = counts_after(generated, accept_len, k1)
        generated = lower(generated)
        vocab, device = self.h.vocab_size, logits.device
        logits = logits[:, :vocab]
        least = [g + 1 for g in generated]
        if all_plain_greedy(reqs, least):  # min_new_tokens reached whatever is accepted
            return logits.argmax(dim=-1), None
        params = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo.from_params(params, vocab, device, generators=False)
        # masked where even K+1 tokens leave it below min_new_tokens, then where the accept
        # length leaves it below: accept_len < min_new_tokens - generated - 1
        logits = penalised_logits(
            logits, reqs, info, self.h.eos_ids, generated=[g + k1 for g in generated]
        )
        below = [
            (i, r.sampling_params.min_new_tokens - g - 1)
            for i, (r, g) in enumerate(zip(reqs, generated))
            if r.grammar is None and g + 1 < r.sampling_params.min_new_tokens <= g + k1
        ]
        if below:
            stops = [min_new_stop_ids(reqs[i], self.h.eos_ids, vocab) for i, _ in below]
            masked = mask_stop_tokens(logits, [i for i, _ in below], stops)
            limits = [0] * len(reqs)
            for i, limit in below:
                limits[i] = limit
            keep_below = accept_len < to_device(limits, device)  # [B]
            logits = torch.where(keep_below.view(-1, 1), masked, logits)
        if info.is_all_greedy:
            return logits.argmax(dim=-1), None
        probs = processed_probs(logits, info)
        # a seeded row's stream is that of its count after the round,
        # draft_seed_offset(generated + accept_len + 1, 1): picked on the device
        uniforms = stream_uniforms(reqs, after, 1, 1)[:, 0]
        return sample_from_probs(probs, info, uniforms), probs
