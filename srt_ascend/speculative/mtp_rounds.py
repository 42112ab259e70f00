"""MTPDecoder's overlapped rounds (`launch` / `finish`, overlap scheduling): round N+1
issued before round N's read, its inputs round N's device results (see mtp_decoder's
docstring); a round `_round_fits` (greedy or sampled) replays as one graph (`_graph_round`)
from those results.
`OverlappedRoundsMixin` is a part of MTPDecoder: it writes the decoder's `_latest` (the round
launched last) and `_read_at`, and calls its `_verify`, `_read`, `_logprobs`, `_estimate`,
`_count`, `_timed`, `_round_fits` and `_graph_round`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from srt_ascend.decoding.base import LaunchedStep, StepRequest
from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.platforms.device_worker import HostCopy
from srt_ascend.sampling.penalty_state import has_penalties
from srt_ascend.sampling.sample_step import sample_tokens
from srt_ascend.speculative.acceptance import AcceptResult
from srt_ascend.speculative.mtp_round_graph import SampledRound
from srt_ascend.speculative.mtp_worker import (
    Counts,
    FirstDrafts,
    Starts,
    counts_after,
    lengths,
    lower,
    state_of,
)
from srt_ascend.speculative.verify import Ragged
from srt_ascend.utils import to_device


@dataclass
class RoundOut:
    """What an overlapped round leaves on the device for its finish and the next round. A
    K = 0 round (the plain decoder's step) accepts nothing: accept_len 0, emitted its sampled
    token; its MTP pass is deferred, so it leaves no d_1 but its target hidden (a copy), and
    its logprobs come from sampling (read on the device worker, as the plain decoder's)."""

    res: AcceptResult  # accept_len [B], emitted [B, K+1]
    logits: torch.Tensor | None  # [B, K+1, V] the target logits the rule read (K = 0: None)
    first: FirstDrafts | None  # the next round's d_1 (K = 0: None)
    starts: torch.Tensor  # [B] this round's first positions
    hidden: torch.Tensor | None = None  # K = 0: [B, D] the target hidden, deferred at finish
    logprobs: TokenLogprobs | None = None  # K = 0: the sampled tokens' logprobs, when asked
    verdict: HostCopy | None = None  # [B, 1+K+1] accept_len | emitted, on the way to the host


@dataclass
class LaunchedRound(LaunchedStep):
    """An overlapped MTP round. Its `starts` (the positions each request's round begins at,
    where a request leaving rolls back to) are known on the host only once the round before
    it is read: `finish` of that round fills them in; before that they hold that round's
    own starts (a lower bound)."""

    k: int = 0
    limits: list[int] | None = None  # each request's k_r (None: k for every one)
    launched_at: float = 0.0  # perf_counter at launch (the round's cost for draft_length)


@dataclass
class _RoundInputs:
    """What `launch` prepared on the host for a round's device work (`_run_round`)."""

    batch: list[StepRequest]
    k: int
    prev: LaunchedRound | None  # the round in flight it follows (None: none)
    index: torch.Tensor  # [B] their req_to_token rows, on the device
    rows: list[int]  # the same rows on the host
    bounds: list[int]  # the lowest position each request may start at
    generated: list[int]  # tokens generated before the round (with prev: before prev)
    limited: torch.Tensor | None  # [B] drafts each row may accept (None: K)
    ragged: Ragged | None  # the ragged verify's rows (None: 1 + K per request)
    whole: bool = False  # the round replays as one graph
    sampled: SampledRound | None = None  # the sampled round graph's block
    picked: torch.Tensor | None = None  # with prev: prev's rows in this order (None: the same)
    first: FirstDrafts | None = None  # without prev: d_1, from the requests' states
    begin: torch.Tensor | None = None  # without prev: [B] the starts, on the device
    last: torch.Tensor | None = None  # without prev: [B, 1] the last committed tokens


class OverlappedRoundsMixin:
    """MTPDecoder's `can_overlap`, `launch`, `finish` (and a K = 0 round's forward)."""

    def can_overlap(self, reqs: list[StepRequest]) -> bool:
        """Rounds whose sampling needs no host value of the round before (its accept lengths
        decide the next round's positions, which only the device knows at launch): one
        rank, backends that read lengths on the device, and no request with a grammar,
        penalties or a min_new_tokens still ahead (their masks follow the committed count;
        seeded streams are picked on the device, `Counts`). Other batches run `step`.
        Adaptive K overlaps too: `launch` chooses each round's K (and refuses the switches
        that run serially)."""
        if not self._takes_bounds or self.runner.tp.size > 1:
            return False
        for r in reqs:
            p = r.sampling_params
            if r.grammar is not None or has_penalties(p) or len(r.output_ids) < p.min_new_tokens:
                return False
        return True

    def launch(self, reqs: list[StepRequest], prev: LaunchedStep | None) -> LaunchedRound | None:
        """A round whose inputs follow `prev` (the round not read yet): its first positions are
        prev's plus prev's accept lengths + 1, its last committed token and d_1 are what prev
        left on the device. Its KV slots cover every position it may write: K+1 beyond the
        furthest prev may commit (positions up to prev's start + (K_prev + 1) + K), allocated
        ahead; `kv_len` then counts them all, until the finish that follows the last round.

        K is chosen here (--speculative-adaptive: `draft_length.peek`, counted by `advance`
        once the round launches) from the acceptance estimates as the last round read left
        them: with prev in flight that is the round before prev, so the choice is one round
        stale. K = 0 is the plain decoder's step over the device inputs, its MTP pass deferred
        at its finish (`MTPWorker.keep_deferred`); K = 0 rounds overlap one after another. Not
        launched (None; the scheduler finishes prev and runs `step`, which chooses from the
        estimates prev leaves, the policy counting one step for the round that runs): a round
        with drafts after a K = 0 step (it first runs the deferred passes from committed
        tokens, `MTPWorker.catch_up`), and a K = 0 round after one with drafts over a seeded
        sampled request (its sampling draws from the host stream of its count, which prev's
        accept lengths leave open). Per-request lengths (`_plan`) ride along as the
        acceptance rule's limits, and as a ragged verify's rows where the strategy builds
        them from device lengths (expand); else a batch mixing k_r = 0 with drafting
        requests is not launched (`step` runs it: ragged, or the zeros apart)."""
        plan = self._plan(reqs, count=False, prev=prev)
        k = self._batch_k(plan)
        ragged = self._ragged(plan, k, on_device=True)
        if k and 0 in plan and ragged is None:  # FIA: `step` runs them
            return None
        device = self.runner.device
        reserved = self._reserve(reqs, prev, k)
        if reserved is None:
            return None
        known, bounds, ends, order = reserved
        free = sum(self.own_length(r) is None for r in reqs)
        if free:  # the round runs: the policy counts it once (as `_plan` peeked)
            self.draft_length.advance(free)
        for r, e in zip(reqs, ends):
            r.kv_len = e
        rows = [r.req_pool_idx for r in reqs]  # a request released meanwhile has none
        # exact without prev; with prev in flight, the count before it (its predecessor is
        # committed): this round's is that + prev's accept length + 1, a range (`Counts`)
        generated = [len(r.output_ids) for r in reqs]
        limited = self._limits(plan, k)  # None when every row drafts k
        fit = self._round_fits(reqs, k, generated) if k else None  # one graph for the round
        round_in = _RoundInputs(
            list(reqs), k, prev, to_device(rows, device), rows, bounds, generated, limited, ragged
        )
        round_in.whole = fit is not None
        if fit:  # the sampled variant: its uniforms drawn here, for each count it may have
            low, span = (generated, 1) if prev is None else ([g + 1 for g in generated], prev.k + 1)
            round_in.sampled = self._sampled_round(round_in.batch, k, low, span)
        if prev is None:
            round_in.last = to_device([[r.last_id] for r in reqs], device)
            round_in.begin = to_device(known, device)
            round_in.first = self.worker.first_of(reqs) if k else None
        elif order != list(range(len(prev.reqs))):
            round_in.picked = to_device(order, device)
        future = self.h.worker.submit(lambda: self._run_round(round_in))
        limits = None if limited is None else plan
        self._latest = LaunchedRound(
            round_in.batch, list(known), future, k, limits, time.perf_counter()
        )
        return self._latest

    @torch.inference_mode()
    def _run_round(self, r: _RoundInputs) -> RoundOut:
        """A launched round's device work, on the device worker: its inputs from prev's
        results (or from the host, without prev), then the whole-round graph, the plain step
        (K = 0), or the draft steps, the verify and the MTP pass."""
        k, k1, device = r.k, r.k + 1, self.runner.device
        if r.prev is None:
            first, start, tail, counts = r.first, r.begin, r.last, r.generated
        else:
            out: RoundOut = r.prev.result.result()
            first, start, tail, counts = _after(out, r.picked, r.generated, r.prev.k, k)
        at = Starts(start, r.bounds)
        if r.whole:  # its slots are gathered inside the graph
            inputs = r.sampled  # with d_1's distributions and counts past the lowest
            if inputs is not None:
                extra = None if r.prev is None else counts.extra
                inputs = inputs._replace(first_probs=first.probs, extra=extra)
            res, nxt = self._graph_round(r.batch, k, r.index, at, tail, first, r.limited, inputs)
            return RoundOut(res, None, nxt, start, verdict=self._copy_verdict(res))
        table = self.h.req_to_token
        loc = table[r.index.view(-1, 1), start.view(-1, 1) + torch.arange(k1, device=device)]
        if not k:
            return self._plain_round(r.batch, loc[:, 0], at, tail, counts, r.rows)
        res, logits, hidden = self._verify(
            r.batch, k, loc, at, tail, first, counts, r.rows, r.limited, r.ragged
        )
        verdict = self._copy_verdict(res)  # before the MTP pass: the read waits for less
        nxt = self.worker.draft_after_verify(
            r.batch, at, loc, hidden, res, counts, None, r.rows, r.ragged
        )
        return RoundOut(res, logits, nxt, start, verdict=verdict)

    def _reserve(self, reqs: list[StepRequest], prev: LaunchedStep | None, k: int):
        """The round's KV positions, its slots allocated (`try_alloc_running`), or None where
        the round cannot launch (see `launch`) or the slots are not there. Returns
        ``(known, bounds, ends, order)``: the starts known on the host (exact without prev;
        with prev in flight, prev's own until its finish fills them in: the KV before them is
        all that is surely valid), the lowest position each request may start at, the end of
        its slots, and each request's row in prev (None without prev). Sets no `kv_len`."""
        k1, order = k + 1, None
        if prev is None:
            states = [state_of(r) for r in reqs]
            if k and any(s.token is None or s.deferred for s in states):
                return None
            known = [r.kv_len for r in reqs]  # exact: nothing in flight
            bounds, ends = known, [st + k1 for st in known]
        else:
            assert isinstance(prev, LaunchedRound)
            if k and not prev.k:  # deferred passes to catch up, from prev's committed token
                return None
            seeded = [r for r in reqs if r.sampling_params.seed is not None]
            if not k and prev.k and any(not r.sampling_params.is_greedy for r in seeded):
                return None  # a K = 0 round samples from host streams: its count must be exact
            order = [prev.index.get(id(r)) for r in reqs]
            if None in order:
                return None
            known = [prev.starts[i] for i in order]  # exact: filled by prev's predecessor
            ahead = prev.k + 1  # the most prev commits
            bounds, ends = [b + ahead for b in known], [b + ahead + k1 for b in known]
        # a round after a larger K may need no new slot: prev's cover it (kv_len never shrinks)
        ends = [max(e, r.kv_len) for r, e in zip(reqs, ends)]
        if max(ends) > self.h.req_to_token.shape[1]:
            return None
        if self.h.kv.try_alloc_running(reqs, [e - r.kv_len for r, e in zip(reqs, ends)]) is None:
            return None
        return known, bounds, ends, order

    def _plain_round(
        self,
        reqs: list[StepRequest],
        loc: torch.Tensor,  # [B] the slots of the round's positions
        at: Starts,  # the positions, on the device, with host bounds
        tail: torch.Tensor,  # [B, 1] the last committed tokens
        counts: list[int] | Counts,  # tokens generated before the round
        rows: list[int],
    ) -> RoundOut:
        """An overlapped K = 0 round, on the device worker: the plain decoder's step (the
        decode kind, tokens and logprobs sampled as without MTP) over device positions; the
        target hidden is copied for the deferred MTP pass (a graph reuses its output). The
        counts are exact for a seeded sampled row (`launch`), lower bounds otherwise (read by
        nothing: min_new_tokens is behind every overlapped row)."""
        seq, bounds = lengths(at, 1)
        fb = self.runner.build_forward_batch(
            ForwardMode.DECODE, tail.view(-1), rows, seq, [1] * len(reqs), loc, None, bounds
        )
        hidden, logits = self.runner.forward_logits(fb, self.plain_kind)
        sampled = sample_tokens(logits, reqs, self.vocab, self.h.eos_ids, lower(counts))
        tokens = sampled.token_ids.view(-1, 1)
        res = AcceptResult(torch.zeros_like(at.device), tokens)
        verdict = self._copy_verdict(res)
        return RoundOut(res, None, None, at.device, hidden.clone(), sampled.logprobs, verdict)

    def finish(self, step: LaunchedStep) -> list[StepRequest]:
        """Reads the round's verdict (the one host read) and commits it; fills in the starts
        of the round launched after it (where a request leaving now rolls back to). A
        request the next round does not hold gets its exact `kv_len` back, the slots past it
        freed. A K = 0 round's positions join the requests' deferred MTP passes; a request it
        finished runs them now, on the device worker (after the round in flight), so that
        the prefix cache takes its slots with their MTP KV, as `defer` does. `draft_length`
        records the accept lengths and the round's seconds: from its launch, or from the
        previous round's read when it was launched before that (a streak's period)."""
        assert isinstance(step, LaunchedRound)
        out: RoundOut = step.result.result()
        after = self._latest if self._latest is not step else None
        if after is None:
            self._latest = None
        verdict = self._read(out.res, out.logits, out.verdict)
        if step.k:
            logprobs = self._logprobs(step.reqs, verdict)
        else:
            lps = out.logprobs
            logprobs = [None if lps is None else lps.rows(i, i + 1) for i in range(len(step.reqs))]
        committed, estimates, accepted, deferred, limits = [], [], [], [], []
        for i, r in enumerate(step.reqs):
            if r.finished:  # found one round late or aborted: this round's tokens are dropped
                continue
            n = verdict.accept_len[i]
            estimates.append(self._estimate(r))
            accepted.append(n)
            limits.append(step.k if step.limits is None else step.limits[i])
            self._count(r, limits[-1], n)
            self.h.commit(r, verdict.emitted[i][: n + 1], logprobs[i])
            committed.append(r)
            if not step.k:
                deferred.append((r, step.starts[i], out.hidden[i : i + 1]))
            valid = r.seq_len - 1  # the last committed token has no KV yet
            j = None if after is None else after.index.get(id(r))
            if j is not None:
                after.starts[j] = valid
            else:
                r.kv_len = valid
                self.h.kv.free_positions(r, valid, r.alloc_len)
        if deferred:
            self.worker.keep_deferred(*map(list, zip(*deferred)))
            done = [r for r, *_ in deferred if r.finished]
            if done:
                self.h.worker.run(lambda: self.worker.catch_up(done, draft=False))
        now = time.perf_counter()
        seconds = now - max(step.launched_at, self._read_at)
        self._read_at = now
        if committed:
            seconds = self._timed(seconds)
            self.draft_length.record(estimates, step.k, accepted, seconds, limits)
        return committed


def _after(out: RoundOut, picked: torch.Tensor | None, generated: list[int], k_prev: int, k: int):
    """A round's inputs from the round before it (`out`, its rows `picked` in this round's
    order, None: the same order), on the device: (d_1, or None for K = 0; the first
    positions; the last committed tokens [B, 1]; the generated counts, a range)."""
    pick = (lambda t: t) if picked is None else (lambda t: t.index_select(0, picked))
    accept_len = pick(out.res.accept_len)
    start = pick(out.starts) + accept_len + 1
    counts = counts_after(generated, accept_len, k_prev + 1)
    tail = pick(out.res.emitted).gather(1, accept_len.view(-1, 1))
    first = None
    if k:  # prev drafted (a K = 0 prev is refused by `_reserve`)
        first = FirstDrafts(
            pick(out.first.tokens),
            None if out.first.probs is None else pick(out.first.probs),
            pick(out.first.hidden),
        )
    return first, start, tail, counts
