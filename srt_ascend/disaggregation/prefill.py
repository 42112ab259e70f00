"""The prefill server's side of a disaggregated pair (`--disaggregation-mode prefill`).

A request with bootstrap fields is scheduled like any other (its own radix cache, chunked
prefill); once its prompt is computed and its first token committed (and, with MTP, the
MTP layer's KV written and d_1 drafted), the scheduler hands it here instead of to the
decode batch. It is held, KV and all, until the decode server's registration for its room
(KVDestination) is here too; then every prompt position's KV, main and MTP layers, is
written into the decode server's slots (one engine batch: a write per run of consecutive
slots per buffer; one batch per decode rank), the MTP state with it. The writes run on the
transfer queue's threads (`TransferQueue`) while the scheduler goes on scheduling; the
request stays here (`sending`, its row and KV held) until its TransferDone message, then the
registration is answered with the first token and the request ends here (its KV goes to the
radix cache). Either half waiting past --disaggregation-timeout, a cancelled room, a
mismatched registration or a failed transfer ends the request with an error on both servers.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from srt_ascend.disaggregation.bootstrap import BootstrapServer
from srt_ascend.disaggregation.protocol import (
    DestinationArrived,
    KVDestination,
    KVResult,
    RoomCancelled,
    RoomExpired,
    TransferDone,
    prompt_digest,
)
from srt_ascend.disaggregation.transfer import (
    KVTransfer,
    TransferQueue,
    TransferStats,
    Write,
    slot_runs,
    write_plan,
)
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)

ENDED_ROOMS_KEPT = 4096  # rooms whose request ended, remembered to answer a late registration


def pool_buffers(runner: ModelRunner) -> tuple[list[torch.Tensor], int]:
    """The KV pool's buffers in layer order and how many belong to the main model."""
    buffers = runner.kv_pool.transfer_buffers()
    per_layer = len(buffers) // runner.kv_pool.layer_num
    return buffers, per_layer * runner.config.num_hidden_layers


class PrefillSide:
    """Held requests and registrations by room; runs in the scheduler thread.

    `finish(req, error)` is the scheduler's: it ends a request that this side holds (None:
    its prefill was sent; else an abort with that message), releasing its KV and emitting
    its last output."""

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        submit: Callable[[object], None],
        finish: Callable[[Any, str | None], None],
    ) -> None:
        self.args = args
        self.runner = runner
        self.submit = submit
        self.finish = finish
        # Under tensor parallelism every rank keeps these states alike (its messages are the
        # leader's, broadcast); the leader alone, which holds the whole latent KV like every
        # rank, runs the engine and the endpoint, decides timeouts (as messages) and tells
        # the others how each transfer went.
        self.tp = runner.tp
        self.buffers, self.num_main = pool_buffers(runner)
        rows, d = runner.req_to_token_pool.size, runner.config.hidden_size
        if self.tp.is_leader:
            self.transfer = KVTransfer(args.host, args.disaggregation_ib_device)
            self.transfer.register(self.buffers)
            # MTP staging: d_1's hidden state and distribution per request row
            self.hidden_stage = torch.zeros(rows, d, dtype=runner.dtype)
            self.probs_stage = torch.zeros(rows, runner.vocab_size, dtype=torch.float32)
            self.transfer.register([self.hidden_stage, self.probs_stage])
            self.queue = TransferQueue(
                self.transfer, lambda room, error: submit(TransferDone(room, error))
            )
        self.rooms: dict[int, Any] = {}  # room -> its live request (queued, running or held)
        self.held: dict[int, tuple[Any, float]] = {}  # room -> (prefilled request, since)
        self.dests: dict[int, tuple[KVDestination, float]] = {}  # room -> (registration, since)
        # room -> (request, registration) whose KV is on its way (the transfer queue's)
        self.sending: dict[int, tuple[Any, KVDestination]] = {}
        self.failures = 0  # requests failed here (a transfer, a timeout, a mismatch)
        # rooms whose request ended here before its registration came: room -> why
        self.ended: OrderedDict[int, str] = OrderedDict()
        self.cancelled: set[int] = set()  # rooms the decode server gave up, request still here
        self._expiring: set[int] = set()  # rooms whose RoomExpired is on its way (leader)
        self.server = None
        if self.tp.is_leader:
            self.server = BootstrapServer(args.host, args.disaggregation_bootstrap_port, submit)

    def _answer(self, room: int, result: KVResult, status: int = 200) -> None:
        if self.server is not None:
            self.server.answer(room, result, status)

    # ---- from the scheduler -------------------------------------------------------------------

    def room_taken(self, room: int) -> bool:
        return room in self.rooms

    def add(self, req) -> None:
        """A new request with bootstrap fields (room not taken: `room_taken`)."""
        self.rooms[req.bootstrap.room] = req
        self.ended.pop(req.bootstrap.room, None)

    def prefilled(self, req) -> None:
        """Its prompt is computed and its first token committed: hold it until its
        registration is here, then send it."""
        room = req.bootstrap.room
        if room in self.cancelled:
            self._fail(req, "the decode server gave up the request", answer=False)
        elif room in self.dests:
            self._send(req, self.dests.pop(room)[0])
        else:
            self.held[room] = (req, time.monotonic())

    def handle(self, msg) -> None:
        if isinstance(msg, DestinationArrived):
            room = msg.dest.room
            if room in self.held:
                self._send(self.held.pop(room)[0], msg.dest)
            elif room in self.ended and room not in self.rooms:
                message = f"the prefill request ended: {self.ended[room]}"
                self._answer(room, KVResult(False, message), 500)
            else:
                self.dests[room] = (msg.dest, time.monotonic())
        elif isinstance(msg, TransferDone):
            self._sent(msg.room, msg.error)
        elif isinstance(msg, RoomExpired):
            self._expire(msg.room)
        elif isinstance(msg, RoomCancelled) and msg.room in self.sending:
            self.cancelled.add(msg.room)  # answered when its transfer ends (it may be writing)
        elif isinstance(msg, RoomCancelled):
            self.dests.pop(msg.room, None)
            self._answer(msg.room, KVResult(False, "cancelled"), 499)
            if msg.room in self.held:
                req, _ = self.held.pop(msg.room)
                self._fail(req, "the decode server gave up the request", answer=False)
            elif msg.room in self.rooms:  # still queued or prefilling: fails once prefilled
                self.cancelled.add(msg.room)

    def take_held(self, hit: Callable[[Any], bool]) -> list:
        """The held requests that `hit` selects, no longer held (an abort): their rooms'
        registrations are answered with the error."""
        taken = [r for r, _ in self.held.values() if hit(r)]
        for r in taken:
            del self.held[r.bootstrap.room]
            self._answer(r.bootstrap.room, KVResult(False, "aborted on the prefill server"))
        return taken

    def forget(self, req) -> None:
        """The request ended (any way): its room is free again; a registration for it that
        is still waiting is answered with the request's end."""
        room = req.bootstrap.room
        if room in self.rooms and self.rooms[room] is not req:
            return  # the room is another live request's (this one was refused for it)
        self.rooms.pop(room, None)  # absent: refused before it was queued (a bad prompt)
        self.cancelled.discard(room)
        reason = req.finished_reason.message if req.finished_reason else "ended"
        if room in self.dests:
            del self.dests[room]
            self._answer(room, KVResult(False, f"the prefill request ended: {reason}"), 500)
        else:  # its registration may still come
            self.ended[room] = reason
            while len(self.ended) > ENDED_ROOMS_KEPT:
                self.ended.popitem(last=False)

    def poll(self) -> None:
        """The leader: what waited past --disaggregation-timeout (held requests without a
        registration, registrations of rooms no request here has) ends, through a
        RoomExpired message, which every rank handles at the same point."""
        if not self.tp.is_leader:
            return
        now, limit = time.monotonic(), self.args.disaggregation_timeout
        late = [room for room, (_, since) in self.held.items() if now - since > limit]
        late += [
            room
            for room, (_, since) in self.dests.items()
            if room not in self.rooms and now - since > limit
        ]
        for room in late:
            if room not in self._expiring:
                self._expiring.add(room)
                self.submit(RoomExpired(room))

    def _expire(self, room: int) -> None:
        self._expiring.discard(room)
        limit = self.args.disaggregation_timeout
        if room in self.held:
            req, _ = self.held.pop(room)
            self._fail(req, f"no decode server registered bootstrap_room {room} in {limit} s")
        elif room in self.dests and room not in self.rooms:
            del self.dests[room]
            self.failures += 1
            message = f"no request with bootstrap_room {room} arrived in {limit} s"
            self._answer(room, KVResult(False, message), 404)

    def busy(self) -> bool:
        return bool(self.held or self.sending)

    def stats(self) -> dict:
        s = self.transfer.stats if self.tp.is_leader else TransferStats()
        return {
            "disagg_held_reqs": len(self.held),
            "disagg_sending_reqs": len(self.sending),
            "disagg_waiting_registrations": len(self.dests),
            **s.counters(self.failures),
        }

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    # ---- sending ------------------------------------------------------------------------------

    def _send(self, req, dest: KVDestination) -> None:
        """Queues the request's KV for its decode server (the leader); on every rank the
        request waits in `sending` for its TransferDone (the leader's message, which every
        rank handles at the same point), holding its row and KV meanwhile."""
        self.sending[dest.room] = (req, dest)
        if not self.tp.is_leader:
            return
        problem = self._mismatch(req, dest)
        if problem is not None:
            self.submit(TransferDone(dest.room, problem))
        else:
            self.queue.put(dest.session, dest.room, self._writes(req, dest))

    def _sent(self, room: int, problem: str | None) -> None:
        """Room `room`'s transfer ended: the registration is answered (the first token, or
        why not) and the request ends here."""
        req, dest = self.sending.pop(room)
        if problem is None and room in self.cancelled:
            problem = "the decode server gave up the request"
        if problem is not None:
            self._fail(req, problem)
            return
        lps = None
        if req.return_logprob and req.first_logprobs is not None:
            lp = req.first_logprobs
            lps = {"chosen": lp.chosen, "top": lp.top, "ids": lp.ids}
        state = req.decoder_state
        draft = getattr(state, "token", None) if dest.hidden_addr else None
        result = KVResult(
            True,
            tokens=list(req.output_ids),
            logprobs=lps,
            cached_tokens=req.cached_tokens,
            draft_token=None if draft is None else int(draft),
            draft_probs=draft is not None and state.probs is not None,
            input_token_logprobs=req.input_token_logprobs,
            input_top_logprobs=req.input_top_logprobs,
            input_token_ids_logprobs=req.input_token_ids_logprobs,
        )
        self._answer(dest.room, result)
        self.finish(req, None)

    def _fail(self, req, message: str, answer: bool = True) -> None:
        self.failures += 1
        logger.warning("disaggregated request %s failed: %s", req.rid, message)
        if answer:
            self._answer(req.bootstrap.room, KVResult(False, message), 500)
        self.finish(req, message)

    def _mismatch(self, req, dest: KVDestination) -> str | None:
        """Why this registration cannot take this request's KV, or None."""
        prompt = req.origin_input_ids
        if dest.prompt_len != len(prompt) or dest.digest != prompt_digest(prompt):
            return "the decode server tokenized the prompt differently"
        rows = [b.stride(0) * b.element_size() for b in self.buffers]
        if (
            dest.num_main != self.num_main
            or dest.row_bytes[: dest.num_main] != rows[: dest.num_main]
        ):
            return "the two servers' KV pools differ (model, dtype or KV layout)"
        if (
            dest.row_bytes[dest.num_main :]
            and dest.row_bytes[self.num_main :] != rows[self.num_main :]
        ):
            return "the decode server runs MTP layers the prefill server does not have"
        if dest.hidden_addr and (
            dest.hidden_bytes != self.hidden_stage[0].nbytes
            or dest.probs_bytes != self.probs_stage[0].nbytes
        ):
            return "the two servers' MTP hidden states differ (model or dtype)"
        if dest.hidden_addr and getattr(req.decoder_state, "token", None) is None:
            if not req.finished:
                return "the prefill server has no MTP draft for the decode server"
        return None

    def _writes(self, req, dest: KVDestination) -> list[Write]:
        """Every prompt position's KV into the decode slots, then the MTP state (copied to
        the request row's staging buffers now), as one engine batch per decode rank."""
        n = len(req.origin_input_ids)
        src_slots = self.runner.req_to_token_pool.host[req.req_pool_idx, :n].tolist()
        runs = slot_runs(src_slots, dest.slots)
        k = len(dest.buffers)  # main layers, and MTP layers where the decode server has them
        src = [b.data_ptr() for b in self.buffers[:k]]
        state = req.decoder_state
        mtp = dest.hidden_addr and getattr(state, "token", None) is not None
        row = req.req_pool_idx
        if mtp:
            self.hidden_stage[row].copy_(state.hidden)
            if state.probs is not None:
                self.probs_stage[row].copy_(state.probs)
        # every decode rank's pool gets the whole latent KV (one batch per rank's engine)
        writes = []
        for session, buffers, hidden_addr, probs_addr in dest.targets():
            srcs, dsts, lens = write_plan(runs, src, buffers, dest.row_bytes)
            if mtp:
                srcs.append(self.hidden_stage[row].data_ptr())
                dsts.append(hidden_addr)
                lens.append(dest.hidden_bytes)
                if state.probs is not None:
                    srcs.append(self.probs_stage[row].data_ptr())
                    dsts.append(probs_addr)
                    lens.append(dest.probs_bytes)
            writes.append((session, srcs, dsts, lens))
        return writes
