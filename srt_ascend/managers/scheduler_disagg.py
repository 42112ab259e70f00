"""The scheduler's disaggregation room: its hooks for --disaggregation-mode prefill | decode.

`DisaggregationMixin` is one room of `Scheduler` (managers/scheduler.py, whose docstring maps
the rooms and the state each writes). The pair's protocol lives in `srt_ascend.disaggregation`
(PrefillSide, DecodeSide); this room builds the side this server plays and gives it the
scheduler's callbacks: a prefill server's request ends once its KV is sent, a decode server's
request gets its row and slots reserved, then continues as if prefilled here.
"""

from __future__ import annotations

from srt_ascend.disaggregation.protocol import KVResult
from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.managers.schedule_batch import FinishReason, Req
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.server_args import ServerArgs


class DisaggregationMixin:
    """Owns `prefill_side`, `decode_side` (at most one is set) and `_disagg_ended` (a
    disaggregated request ended since the last idle check).

    Writes besides: `running` (a decode server's request joins it once its KV arrived) and
    each such request's KV bookkeeping (row, slots, lengths). Uses `kv`, `tree`,
    `req_to_token_pool`, `args`, and from the other rooms `submit`, `has_work`,
    `_check_when_idle` (loop, messages), `_finish`, `_commit`, `_flush_outputs`,
    `_make_output`, `_emit` (decode)."""

    def _init_disaggregation(self, server_args: ServerArgs, runner: ModelRunner) -> None:
        """The last part of `Scheduler.__init__`: this server's side of the pair, if any."""
        # --disaggregation-mode: the prefill or the decode server's side of the pair (or none)
        self.prefill_side = self.decode_side = None
        self._disagg_ended = False  # a disaggregated request ended since the last idle check
        if server_args.disaggregation_mode == "prefill":
            from srt_ascend.disaggregation.prefill import PrefillSide

            self.prefill_side = PrefillSide(server_args, runner, self.submit, self._end_prefilled)
        elif server_args.disaggregation_mode == "decode":
            from srt_ascend.disaggregation.decode import DecodeSide

            self.decode_side = DecodeSide(
                server_args,
                runner,
                self.submit,
                self._reserve_prompt,
                self._activate,
                lambda req, message: self._finish(req, FinishReason("abort", message=message)),
                self._release_given_up,
                self._end_for_client,
            )

    def _poll_disaggregation(self) -> None:
        """Each round of the loop: the prefill side's timeouts, the decode side's
        reservations; the idle check once disaggregated requests ended and nothing runs."""
        if self.prefill_side is not None:
            self.prefill_side.poll()
        if self.decode_side is not None:
            held = (
                len(self.running) + len(self.decode_side.awaiting) + (self.chunked_req is not None)
            )
            self.decode_side.poll(self.args.max_running_requests - held - len(self.waiting))
        if self._disagg_ended and not self.has_work():
            self._disagg_ended = False
            self._check_when_idle()

    def _disaggregation_busy(self) -> bool:
        """Whether requests are held outside the queue and the batch (between the servers)."""
        return any(
            side is not None and side.busy() for side in (self.prefill_side, self.decode_side)
        )

    def _forget_room(self, reqs: list[Req]) -> None:
        """Prefill server: these requests ended here (sent, failed or aborted): their rooms
        are free, and a registration still to come for one is answered at once. (A request
        whose first token finished it is not ended by that: it is still to be sent.)"""
        if self.prefill_side is not None:
            for r in reqs:
                if r.bootstrap is not None:
                    self.prefill_side.forget(r)

    # ---- prefill-decode disaggregation --------------------------------------------------------

    def _end_prefilled(self, req: Req, error: str | None) -> None:
        """Prefill server: a request held for its decode server ends, its KV sent (error
        None: its client gets a `length` finish at its first tokens) or not (an abort)."""
        if error is not None:
            reason = FinishReason("abort", message=error)
        else:
            reason = req.finished_reason or FinishReason("length", length=len(req.output_ids))
        self._finish(req, reason)
        self._disagg_ended = True

    def _reserve_prompt(self, req: Req) -> bool:
        """Decode server: a request row and slots for every prompt position (nothing matched
        in this server's cache: the prefill server sends all of it); False when they are
        not free now (evicting from the prefix cache first)."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            return False
        req.req_pool_idx, req.last_node = rows[0], self.tree.root_node
        req.kv_len = req.alloc_len = req.prefix_len = 0
        if self.kv.alloc_positions(req, len(req.origin_input_ids)):
            return True
        self.req_to_token_pool.free(rows[0])
        req.req_pool_idx = req.last_node = None
        return False

    def _activate(self, req: Req, result: KVResult) -> None:
        """Decode server: the prompt's KV (and with MTP d_1) arrived: the request continues
        as if prefilled here (its first tokens committed), in the decode batch."""
        req.kv_len = len(req.origin_input_ids)
        req.cached_tokens = result.cached_tokens
        # the prompt's logprobs, computed by the prefill server (docs/disaggregation.md)
        req.input_token_logprobs = [tuple(t) for t in result.input_token_logprobs]
        req.input_top_logprobs = [_top(t) for t in result.input_top_logprobs]
        req.input_token_ids_logprobs = [_top(t) for t in result.input_token_ids_logprobs]
        if not result.tokens:  # max_new_tokens 0: nothing to generate
            self._finish(req, FinishReason("length", length=0))
        else:
            lps = None
            if result.logprobs is not None:
                lp = result.logprobs
                lps = TokenLogprobs(lp["chosen"], [_top(t) for t in lp["top"]], lp["ids"])
            self._commit(req, result.tokens, lps)
            if req.finished:
                self.kv.release(req)
            else:
                self.running.append(req)
            self._flush_outputs()
        self._disagg_ended = True

    def _end_for_client(self, req: Req, message: str) -> None:
        """Decode server: a registered request ends for its client (an abort output); its row
        and slots stay held until its prefill server answers (`_release_given_up`)."""
        req.finished_reason = FinishReason("abort", message=message)
        self._emit([self._make_output(req)])

    def _release_given_up(self, req: Req) -> None:
        """Decode server: an aborted request's prefill server answered: its row and slots
        are free again (its client heard of the end at the abort)."""
        self.kv.release(req)
        self._disagg_ended = True


def _top(entries: list | None) -> list | None:
    """A top-logprobs list read back from JSON: its (logprob, token id) pairs as tuples."""
    return None if entries is None else [tuple(e) for e in entries]
