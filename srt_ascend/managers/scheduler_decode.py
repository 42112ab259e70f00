"""The scheduler's decode room: the decode step, commits (stop checks) and outputs.

`DecodeMixin` is one room of `Scheduler` (managers/scheduler.py, whose docstring maps the
rooms and the state each writes). Every step's tokens, prefill's first ones included, arrive
through `_commit` (the decoder's commit callback) and leave as ReqOutputs through `_emit`.
"""

from __future__ import annotations

import logging
import os

from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.managers.batch_log import PoolUsage
from srt_ascend.managers.io_struct import ReqOutput
from srt_ascend.managers.schedule_batch import FinishReason, Req

# An unstreamed request's outputs between its first and its last (SGLang's
# SGLANG_FORCE_STREAM_INTERVAL, 50): the tokens arrive with the finish all the same, and a step
# over many such requests no longer wakes the event loop for each of them (at 62 requests on 2
# CPU cores, a step's outputs held the GIL about 1.2 ms of its 26).
DEFAULT_FORCE_STREAM_INTERVAL = 50


def _force_stream_interval() -> int:
    """SGLANG_FORCE_STREAM_INTERVAL, or DEFAULT_FORCE_STREAM_INTERVAL (with one warning line)
    when it is no positive integer."""
    value = os.environ.get("SGLANG_FORCE_STREAM_INTERVAL")
    if value is None:
        return DEFAULT_FORCE_STREAM_INTERVAL
    if value.strip().isdigit() and int(value) >= 1:
        return int(value)
    logging.getLogger(__name__).warning(
        "SGLANG_FORCE_STREAM_INTERVAL=%r is not a positive integer: using %d",
        value,
        DEFAULT_FORCE_STREAM_INTERVAL,
    )
    return DEFAULT_FORCE_STREAM_INTERVAL


FORCE_STREAM_INTERVAL = _force_stream_interval()


class DecodeMixin:
    """Runs a serial decode step over `running`, commits tokens, builds and emits outputs.

    Writes: `running` (a serial decode step drops the requests it finished), `_outputs` (the
    outputs queued by commits during a step, emitted by `_flush_outputs`), and each request's
    output ids, pending outputs and finish reason. Uses `decoder`, `kv`, `stop_checker`,
    `batch_log`, `runner`, `allocator`, `tree`, `emit`; `_make_output` reads `prefill_side`
    (disaggregation) and `_finish` calls `_forget_room` (disaggregation)."""

    # ---- decode -----------------------------------------------------------------------------

    def _next_batch(self, joining: list[Req]) -> int:
        """Requests the next decode step is expected to run: the running ones, those joining
        now, and those the loop prefills first (waiting, the chunked one, and the ones that
        arrived during this prefill, not received yet), within --max-running-requests. A
        burst of arrivals is then planned for as a whole from its first prefill (the leader's
        view: its only reader, adaptive K, runs on one rank)."""
        coming = len(self.waiting) + (self.chunked_req is not None) + self.inbox.qsize()
        expected = len(self.running) + len(joining) + coming
        return min(expected, self.args.max_running_requests)

    def _run_decode(self) -> None:
        before = {id(r): len(r.output_ids) for r in self.running}
        stepped = self.decoder.step(self.running)
        new_tokens = sum(len(r.output_ids) - before[id(r)] for r in stepped)
        self.batch_log.decode(len(stepped), new_tokens, self._pool_usage(), len(self.waiting))
        for r in stepped:
            if r.finished:
                self.kv.release(r)
        self.running = [r for r in stepped if not r.finished]
        self._flush_outputs()

    def _pool_usage(self) -> PoolUsage:
        """KV tokens held by requests (SGLang's #token: neither free nor evictable cache)."""
        total = self.runner.max_total_tokens
        free = self.allocator.available_size() + self.tree.evictable_size()
        return PoolUsage(total - free, total)

    # ---- sampling and stop conditions -------------------------------------------------------

    def _commit(self, req: Req, tokens: list[int], logprobs: TokenLogprobs | None = None) -> None:
        """Appends tokens one by one, stopping at the first that finishes the request (which
        keeps its KV until the step releases it), and queues the request's output."""
        committed = []
        for j, t in enumerate(tokens):
            req.output_ids.append(t)
            committed.append(t)
            if req.return_logprob and logprobs is not None and len(req.output_ids) == 1:
                req.first_logprobs = logprobs.rows(j, j + 1)  # a prefill server sends them
            if req.return_logprob and logprobs is not None:
                req.pending_logprobs.append((logprobs.chosen[j], t))
                req.pending_top_logprobs.append(logprobs.top[j])
                req.pending_ids_logprobs.append(_with_ids(logprobs.ids[j], req.token_ids_logprob))
            if req.grammar is not None and not req.grammar.accept(t):
                # Masks make this unreachable; a grammar that disagrees must not go silent.
                req.finished_reason = FinishReason(
                    "abort", message=f"token {t} does not follow the request's grammar"
                )
                break
            reason = self.stop_checker.check(req, self.runner.context_len)
            if reason is not None:
                req.finished_reason = reason
                break
        req.pending_ids.extend(committed)
        if req.finished or self._output_due(req):
            self._outputs.append(self._make_output(req))

    def _output_due(self, req: Req) -> bool:
        """--stream-interval N (SGLang's meaning): a request's first tokens are sent at once,
        then whenever N or more wait (a speculative step may commit several); an unstreamed
        request's whenever FORCE_STREAM_INTERVAL wait (its response comes at the end); its
        last output (finish or abort) carries whatever waits."""
        if not req.pending_ids:
            return False
        if len(req.output_ids) == len(req.pending_ids):  # the first tokens
            return True
        every = self.args.stream_interval if req.stream else FORCE_STREAM_INTERVAL
        return len(req.pending_ids) >= every

    def _flush_outputs(self) -> None:
        outputs, self._outputs = self._outputs, []
        self._emit(outputs)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Ends the request: its KV released and its last output emitted, the output even if
        releasing raises (its client must not wait for ever)."""
        req.finished_reason = reason
        try:
            self.kv.release(req)
        finally:
            self._emit([self._make_output(req)])
            self._forget_room([req])

    # ---- outputs ----------------------------------------------------------------------------

    def _make_output(self, req: Req) -> ReqOutput:
        """The request's next output: the tokens and logprobs not sent yet (taken from it),
        its finish reason if finished, its counters."""
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=req.pending_ids,
            finish_reason=req.finished_reason.to_json() if req.finished_reason else None,
            stop_text=req.finished_reason.stop_text if req.finished_reason else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            spec_verify_ct=req.spec_verify_ct,
            spec_draft_tokens=req.spec_draft_tokens,
            spec_accepted_tokens=req.spec_accepted_tokens,
            output_token_logprobs=req.pending_logprobs,
            output_top_logprobs=req.pending_top_logprobs,
            output_token_ids_logprobs=req.pending_ids_logprobs,
        )
        req.pending_ids = []
        req.pending_logprobs, req.pending_top_logprobs, req.pending_ids_logprobs = [], [], []
        if req.return_logprob and not req.input_logprobs_sent and (req.output_ids or req.finished):
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            out.input_token_ids_logprobs = req.input_token_ids_logprobs
            req.input_logprobs_sent = True
            if req.bootstrap is not None and self.prefill_side is not None:
                # the decode server's answer carries them: a prefill server's own answer,
                # which sglang-router merges into it, has none (docs/disaggregation.md)
                out.input_token_logprobs, out.input_top_logprobs = [], []
                out.input_token_ids_logprobs = []
        return out

    def _emit(self, outputs: list[ReqOutput]) -> None:
        if outputs:
            self.emit(outputs)


def _with_ids(values: list[float], asked: list[int] | None) -> list[tuple[float, int]] | None:
    """One position's token_ids_logprob entry: (logprob, id) per asked id, in asked order."""
    return list(zip(values, asked)) if asked else None
