"""The scheduler's faults room: aborts, retraction, and the requests of a step that raised.

`FaultsMixin` is one room of `Scheduler` (managers/scheduler.py, whose docstring maps the
rooms and the state each writes). It ends or sends back requests outside their normal finish.
"""

from __future__ import annotations

import logging

from srt_ascend.managers.io_struct import ABORTED_BY_CLIENT
from srt_ascend.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger("srt_ascend.managers.scheduler")  # every room logs as the scheduler

# The finish message of a request that a contained fault (in a step or a message) ended.
INTERNAL_ERROR = "internal error in the scheduler (see server log)"


class FaultsMixin:
    """Aborts (a client's or all), a failed step's requests, retraction when KV runs out.

    Writes: `waiting`, `running`, `chunked_req` (the requests it takes out; a retracted one
    goes back at the queue's head), `in_flight` and `_launched` (cleared after a fault),
    `num_retractions`. Uses `kv`, `tree`, `decoder`, `worker`, and from the other rooms
    `_roll_back` (loop), `_finish`, `_make_output`, `_emit`, `_flush_outputs` (decode),
    `prefill_side`, `decode_side`, `_end_for_client`, `_forget_room` (disaggregation).
    `_retract` is KVBook's callback, called inside a step's allocation."""

    def abort(self, rids: str | set[str], msg: str = ABORTED_BY_CLIENT) -> None:
        """Aborts the requests with these ids (all of them when "" is one), freeing everything
        they hold; each gets a last output with finish_reason abort and message `msg`. One pass
        over the queue and the batch whatever the number of ids (set lookups, no removals)."""
        rids = {rids} if isinstance(rids, str) else rids
        every = "" in rids

        def hit(r: Req) -> bool:
            return every or r.rid in rids

        victims = [r for r in self.waiting if hit(r)]
        if victims:
            self.waiting = [r for r in self.waiting if not hit(r)]
        if self.chunked_req is not None and hit(self.chunked_req):
            victims.append(self.chunked_req)
            self.chunked_req = None
        stopped = [r for r in self.running if hit(r)]
        if stopped:
            self.running = [r for r in self.running if not hit(r)]
        victims += stopped
        if self.prefill_side is not None:
            victims += self.prefill_side.take_held(hit)
        if self.decode_side is not None:
            queued, registered = self.decode_side.take(hit)
            victims += queued
            # they keep their row and slots until their prefill server answers (it may be
            # writing into them): only their clients hear of the end now
            for r in registered:
                self._end_for_client(r, msg)
        for r in victims:
            r.finished_reason = FinishReason("abort", message=msg)
            self._roll_back(r)
        holding = [r for r in victims if r.req_pool_idx is not None]
        try:
            if holding:  # on the device worker, after the step in flight
                self.worker.run(lambda: self.decoder.leaving(holding))
            for r in victims:
                self.kv.release(r)
        finally:  # one emit for all: their clients must not wait, even if a release raised
            self._emit([self._make_output(r) for r in victims])
            self._forget_room(victims)

    def _fail_in_flight(self, message: str) -> None:
        """After a step raised: its requests end with an abort finish (streamed to their
        clients) and give back everything they hold; the other requests carry on. Those the
        step retracted before the fault are back in the waiting queue, hold nothing and did
        not run: they stay queued."""
        self._flush_outputs()  # tokens committed before the fault still reach their clients
        for r in self.in_flight:
            self._roll_back(r)
        self._launched = None
        queued = {id(r) for r in self.waiting}
        failed = [r for r in self.in_flight if id(r) not in queued]
        self.in_flight = []
        ids = {id(r) for r in failed} | queued
        self.running = [r for r in self.running if id(r) not in ids]
        if self.chunked_req is not None and id(self.chunked_req) in ids:
            self.chunked_req = None
        for r in failed:
            r.finished_reason = FinishReason("abort", message=message)
            self.kv.release(r)
            self._emit([self._make_output(r)])
        self._forget_room(failed)

    def _retract(self, victim: Req, staying: list[Req]) -> None:
        """KVBook's callback when a step's allocation does not fit: sends the most recently
        admitted request back to the queue, keeping its outputs."""
        if not staying and not self.waiting and self.tree.evictable_size() == 0:
            # Nothing else holds memory: it can never fit.
            self._finish(victim, FinishReason("abort", message="KV cache pool too small"))
            return
        self.decoder.leaving([victim])  # on the device worker: in the step that retracts
        self.kv.release(victim)
        victim.retracted += 1
        self.num_retractions += 1
        self.waiting.insert(0, victim)
        logger.info("retracted request %s (KV pool full)", victim.rid)
