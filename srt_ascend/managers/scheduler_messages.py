"""The scheduler's messages room: the io_struct messages it is sent, and its state queries.

`MessagesMixin` is one room of `Scheduler` (managers/scheduler.py, whose docstring maps the
rooms and the state each writes). The loop takes each round's messages from the inbox (and
under tensor parallelism broadcasts them in `wire_form`); this room handles them, a fault in
one contained as a step's is.
"""

from __future__ import annotations

import dataclasses
import logging

from srt_ascend.disaggregation.protocol import (
    DestinationArrived,
    KVArrived,
    KVLate,
    RoomCancelled,
    RoomExpired,
    TransferDone,
)
from srt_ascend.managers.io_struct import (
    ABORTED_BY_CLIENT,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    ReqOutput,
    ServingStarted,
    TokenizedGenerateReq,
)
from srt_ascend.managers.schedule_batch import FinishReason
from srt_ascend.managers.scheduler_faults import INTERNAL_ERROR

logger = logging.getLogger("srt_ascend.managers.scheduler")  # every room logs as the scheduler


class MessagesMixin:
    """Dispatches messages to the rooms (requests to admission, aborts to faults, the pair's
    messages to the disaggregation side), answers cache flushes and state queries, and runs
    the idle self-check.

    Writes: `_serving` (set by ServingStarted), the prefix cache (`flush_cache` empties it)
    and the reply futures of the messages it answers. Reads, for `internal_state` and the
    idle check, `runner`, `allocator`, `tree`, `req_to_token_pool`, `waiting`, `running`,
    `chunked_req` and the counters; calls `_add_request` (admission), `abort` (faults),
    `_emit` (decode), `has_work` (loop), `_disaggregation_busy` (disaggregation)."""

    def handle_all(self, msgs: list) -> None:
        """Handles messages in order (`handle_contained`), each run of consecutive aborts as
        one: a client that leaves a batch of N prompts sends N aborts, and one pass over the
        queue and the batch for all of them keeps that linear in N."""
        aborts: set[str] = set()
        message = ABORTED_BY_CLIENT
        for msg in msgs:
            if isinstance(msg, AbortReq):
                if aborts and msg.message != message:  # a run shares its finish message
                    self.handle_contained(AbortReq(aborts, message))
                    aborts = set()
                message = msg.message
                aborts |= {msg.rid} if isinstance(msg.rid, str) else msg.rid
                continue
            if aborts:
                self.handle_contained(AbortReq(aborts, message))
                aborts = set()
            self.handle_contained(msg)
        if aborts:
            self.handle_contained(AbortReq(aborts, message))

    def handle_contained(self, msg) -> None:
        """`handle`, with a fault contained as a step's is: with one rank a message whose
        handling raises is logged and answered (a request that could not be added ends with
        an abort finish, a reply future gets the exception) and the loop goes on. Under tensor
        parallelism it raises: the ranks would no longer agree."""
        try:
            self.handle(msg)
        except Exception as e:
            if self.tp.size > 1:
                raise
            logger.exception("handling %s failed", type(msg).__name__)
            self._answer_failed(msg, e)

    def _answer_failed(self, msg, error: Exception) -> None:
        """What the sender of a message whose handling raised still gets (see
        handle_contained)."""
        if isinstance(msg, TokenizedGenerateReq):  # not queued: queuing is the last thing done
            reason = FinishReason("abort", message=INTERNAL_ERROR).to_json()
            self._emit([ReqOutput(msg.rid, [], reason, prompt_tokens=len(msg.input_ids))])
        elif isinstance(msg, (FlushCacheReq, GetInternalStateReq)):
            if msg.reply is not None and not msg.reply.done():
                msg.reply.set_exception(error)

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.message)
        elif isinstance(msg, FlushCacheReq):
            flushed = self.flush_cache()
            if msg.reply is not None:
                msg.reply.set_result(flushed)
        elif isinstance(msg, GetInternalStateReq):
            msg.reply.set_result(self.internal_state())
        elif isinstance(msg, ServingStarted):
            self._serving = True
        elif (
            isinstance(msg, (DestinationArrived, RoomCancelled, RoomExpired, TransferDone))
            and self.prefill_side
        ):
            self.prefill_side.handle(msg)
        elif isinstance(msg, (KVArrived, KVLate)) and self.decode_side:
            self.decode_side.handle(msg)

    # ---- flush / state ----------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Empties the prefix cache; False (not now) while requests run or are held between
        disaggregated servers (a prefill server's request being sent holds cache nodes)."""
        if self.has_work() or self._disaggregation_busy():
            return False
        self.tree.reset()
        return True

    def internal_state(self) -> dict:
        graphs = self.runner.graph_runner
        return {
            "max_total_num_tokens": self.runner.max_total_tokens,
            **self.runner.weight_memory,  # weight_bytes, quantized_weight_bytes(_as_bf16)
            "available_kv_tokens": self.allocator.available_size(),
            "cached_tokens_in_tree": self.tree.total_size(),
            "num_running_reqs": len(self.running) + (1 if self.chunked_req else 0),
            "num_queue_reqs": len(self.waiting),
            "num_retractions": self.num_retractions,
            "num_overlapped_steps": self.num_overlapped_steps,
            "intra_op_threads": self.runner.eager_threads,  # --num-threads or the platform's
            "cache_hit_rate": self.total_cached_tokens / max(1, self.total_prompt_tokens),
            "graph_batch_sizes": list(graphs.buckets) if graphs else [],
            "graph_replays": dict(graphs.replays) if graphs else {},
            # JSON object keys: the KV window as a string (/server_info serialises this)
            "graph_kv_window_replays": (
                {str(w): n for w, n in graphs.window_replays.items()} if graphs else {}
            ),
            "graph_compiled_replays": dict(graphs.compiled_replays) if graphs else {},
            # the idle self-check's verdict now ("busy" while requests run or are held)
            "kv_invariant": (
                "busy"
                if self.has_work() or self._disaggregation_busy()
                else self.idle_invariant_problem() or "ok"
            ),
            **(self.prefill_side.stats() if self.prefill_side else {}),
            **(self.decode_side.stats() if self.decode_side else {}),
            "torch_compile": graphs.compile_queue.progress() if graphs else {},
            **self.decoder.stats(),
        }

    # ---- idle self-check --------------------------------------------------------------------

    def _check_when_idle(self) -> None:
        if self._disaggregation_busy():
            return
        problem = self.idle_invariant_problem()
        if problem is None:
            return
        logger.error("KV invariant broken while idle: %s", problem)
        if self.args.kv_invariant_check == "fatal":
            raise RuntimeError(f"KV invariant broken while idle: {problem}")

    def idle_invariant_problem(self) -> str | None:
        """With no request in the scheduler, every KV slot is free or owned by the prefix
        cache, nothing in the cache is locked, and every request row is free (SGLang's idle
        self-check). Returns what is wrong, or None."""
        free, cached = self.allocator.available_size(), self.tree.total_size()
        total = self.runner.max_total_tokens
        problems = []
        if free + cached != total:
            problems.append(f"{free} free + {cached} cached KV slots != {total}")
        if self.tree.protected_size():
            problems.append(f"{self.tree.protected_size()} cached slots still locked")
        rows = self.req_to_token_pool
        if rows.available_size() != rows.size:
            problems.append(f"{rows.size - rows.available_size()} request rows still held")
        return "; ".join(problems) or None


def wire_form(msgs: list) -> list:
    """The messages the other ranks of a tensor-parallel group need, without the leader's
    reply futures (state queries have no effect to repeat, a cache flush does) and without
    compiled grammars (the ranks compile their own: see Scheduler._grammar_of)."""
    wire = []
    for msg in msgs:
        if isinstance(msg, FlushCacheReq):
            wire.append(dataclasses.replace(msg, reply=None))
        elif isinstance(msg, TokenizedGenerateReq) and msg.grammar is not None:
            wire.append(dataclasses.replace(msg, grammar=None))
        elif not isinstance(msg, GetInternalStateReq):
            wire.append(msg)
    return wire
