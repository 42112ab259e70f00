"""The decode server's side of a disaggregated pair (`--disaggregation-mode decode`).

A request with bootstrap fields waits here (not in the scheduler's queue) until a request row
and slots for its whole prompt are free (`reserve`); then a thread registers them at its
prefill server's bootstrap endpoint (KVDestination: this server's transfer-engine session, the
address of every KV buffer, main and MTP layers, the slots; with MTP where d_1's hidden state
and distribution go) and waits for the answer, which comes back through the scheduler's inbox
(KVArrived). With the KV written, the request joins the decode batch as if this server had
prefilled it (`activate`: the first tokens committed, with MTP its d_1 in place, so its first
step is a verify step); nothing of the prompt is computed here.

An abort while the registration is out ends the request for its client at once, but its row
and slots stay held (the prefill server may be writing into them) until the answer comes:
the prefill server is told (`/disagg/cancel`) and answers at once when it is not sending.

With --tp-size N > 1 every rank process has its own pool (the whole latent KV) and its own
transfer engine with that pool registered; the ranks exchange their sessions and addresses
once at start, and rank 0's registration carries them all (`KVDestination.peers`): the
prefill server writes the prompt's KV into every rank's pool. Rank 0 alone registers and
cancels; the answer (KVArrived) reaches the other ranks as every scheduler message does, so
all ranks take, activate, fail and release each request at the same point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from srt_ascend.disaggregation.bootstrap import cancel_room, register_and_wait
from srt_ascend.disaggregation.prefill import pool_buffers
from srt_ascend.disaggregation.protocol import (
    KVArrived,
    KVDestination,
    KVLate,
    KVResult,
    prompt_digest,
)
from srt_ascend.disaggregation.transfer import KVTransfer
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The decode side waits this many times --disaggregation-timeout for the prefill server's
# answer before it ends the request for its client (the prefill server's own timeouts answer
# first unless it hangs); the request's slots stay held until an answer or a broken
# connection says the prefill server will not write into them.
ANSWER_TIMEOUT_FACTOR = 4


class DecodeSide:
    """Runs in the scheduler thread (the registration threads only call `submit`).

    Scheduler handles: `reserve(req) -> bool` takes a request row and slots for its prompt
    (False: not now); `activate(req, result)` puts a request whose KV arrived into the decode
    batch; `fail(req, message)` ends a request with an abort (releasing what it holds) and
    emits its last output; `release(req)` gives back what a request that already ended
    holds; `end_for_client(req, message)` ends a request for its client only (an abort
    output; its row and slots stay held)."""

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        submit: Callable[[object], None],
        reserve: Callable[[Any], bool],
        activate: Callable[[Any, KVResult], None],
        fail: Callable[[Any, str], None],
        release: Callable[[Any], None],
        end_for_client: Callable[[Any, str], None],
    ) -> None:
        self.args = args
        self.runner = runner
        self.submit = submit
        self.reserve, self.activate, self.fail, self.release = reserve, activate, fail, release
        self.end_for_client = end_for_client
        self.transfer = KVTransfer(args.host, args.disaggregation_ib_device)
        self.buffers, self.num_main = pool_buffers(runner)
        self.transfer.register(self.buffers)
        self.mtp = args.spec_enabled
        rows, d = runner.req_to_token_pool.size, runner.config.hidden_size
        # where the prefill server writes d_1's hidden state and distribution, per request row
        self.hidden_in = torch.zeros(rows, d, dtype=runner.dtype)
        self.probs_in = torch.zeros(rows, runner.vocab_size, dtype=torch.float32)
        self.transfer.register([self.hidden_in, self.probs_in])
        self.tp = runner.tp
        # every rank's engine session and addresses (rank order), for the registrations
        self.ranks = self.tp.all_gather_object(
            {
                "session": self.transfer.session_id,
                "buffers": [b.data_ptr() for b in self._buffers_sent()],
                "hidden_addr": self.hidden_in.data_ptr() if self.mtp else 0,
                "probs_addr": self.probs_in.data_ptr() if self.mtp else 0,
            }
        )
        self.pending: list = []  # waiting for a row and slots
        self.awaiting: dict[str, Any] = {}  # rid -> request whose registration is out
        self.given_up: set[str] = set()  # rids among them ended for their client already
        self.failures = 0
        self._pool = ThreadPoolExecutor(args.max_running_requests, "disagg-register")
        # cancels apart: every registration thread may be waiting for an answer
        self._cancels = ThreadPoolExecutor(2, "disagg-cancel")

    # ---- from the scheduler -------------------------------------------------------------------

    def add(self, req) -> None:
        self.pending.append(req)

    def poll(self, free_rows: int) -> None:
        """Registers the pending requests that get a row and slots now, in order (at most
        `free_rows` of them)."""
        while self.pending and free_rows > 0:
            req = self.pending[0]
            if not self.reserve(req):
                return
            self.pending.pop(0)
            free_rows -= 1
            self.awaiting[req.rid] = req
            if self.tp.is_leader:
                dest = self._destination(req)
                self._pool.submit(self._register, req.rid, req.bootstrap, dest)

    def handle(self, msg: KVArrived | KVLate) -> None:
        if isinstance(msg, KVLate):
            req = self.awaiting.get(msg.rid)
            if req is not None and msg.rid not in self.given_up:
                self.given_up.add(msg.rid)
                self.failures += 1
                self.end_for_client(req, msg.message)
            return
        req = self.awaiting.pop(msg.rid, None)
        if req is None:
            return
        if msg.rid in self.given_up:  # ended for its client; the prefill side is done with it
            self.given_up.discard(msg.rid)
            self.release(req)
        elif not msg.result.ok:
            self.failures += 1
            self.fail(req, f"the prefill server did not send the KV: {msg.result.error}")
        else:
            self._take_mtp_state(req, msg.result)
            self.activate(req, msg.result)

    def take(self, hit: Callable[[Any], bool]) -> tuple[list, list]:
        """An abort: (pending requests `hit` selects, removed: they hold nothing; awaiting
        ones it selects, which keep their row and slots until their answer comes and are
        ended for their clients by the caller now; their prefill server is told)."""
        pending = [r for r in self.pending if hit(r)]
        if pending:
            self.pending = [r for r in self.pending if not hit(r)]
        out = [r for rid, r in self.awaiting.items() if rid not in self.given_up and hit(r)]
        for r in out:
            self.given_up.add(r.rid)
            b = r.bootstrap
            if self.tp.is_leader:
                self._cancels.submit(cancel_room, b.host, b.port, b.room)
        return pending, out

    def busy(self) -> bool:
        return bool(self.pending or self.awaiting)

    def stats(self) -> dict:
        return {
            "disagg_pending_reqs": len(self.pending),
            "disagg_awaiting_reqs": len(self.awaiting),
            **self.transfer.stats.counters(self.failures),
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cancels.shutdown(wait=False, cancel_futures=True)

    # ---- internals ----------------------------------------------------------------------------

    def _buffers_sent(self) -> list[torch.Tensor]:
        """The pool buffers the prefill server writes (the MTP layers' only with MTP here)."""
        return self.buffers if self.mtp else self.buffers[: self.num_main]

    def _destination(self, req) -> KVDestination:
        """The registration of request `req`'s row and slots, for every rank's pool (the
        slots and the row are the same on every rank; each rank's addresses are its own)."""
        prompt = req.origin_input_ids
        row = req.req_pool_idx
        slots = self.runner.req_to_token_pool.host[row, : len(prompt)].tolist()
        hidden_bytes = self.hidden_in[row].nbytes if self.mtp else 0
        probs_bytes = self.probs_in[row].nbytes if self.mtp else 0
        at = [
            {
                **r,
                "hidden_addr": r["hidden_addr"] + row * hidden_bytes,
                "probs_addr": r["probs_addr"] + row * probs_bytes,
            }
            for r in self.ranks
        ]
        return KVDestination(
            room=req.bootstrap.room,
            session=at[0]["session"],
            prompt_len=len(prompt),
            digest=prompt_digest(prompt),
            slots=slots,
            buffers=at[0]["buffers"],
            row_bytes=[b.stride(0) * b.element_size() for b in self._buffers_sent()],
            num_main=self.num_main,
            hidden_addr=at[0]["hidden_addr"],
            hidden_bytes=hidden_bytes,
            probs_addr=at[0]["probs_addr"],
            probs_bytes=probs_bytes,
            peers=at[1:],
        )

    def _register(self, rid: str, bootstrap, dest: KVDestination) -> None:
        """In a registration thread: the long request to the prefill server, its answer into
        the scheduler's inbox."""
        timeout = self.args.disaggregation_timeout * ANSWER_TIMEOUT_FACTOR

        def late() -> None:  # the request ends for its client; the slots wait for the answer
            message = f"the prefill server did not answer in {timeout:g} s"
            logger.warning("request %s: %s; its slots stay held until it does", rid, message)
            self.submit(KVLate(rid, message))
            self._cancels.submit(cancel_room, bootstrap.host, bootstrap.port, bootstrap.room)

        result, answered = register_and_wait(bootstrap.host, bootstrap.port, dest, timeout, late)
        if not answered:
            logger.warning("request %s: %s", rid, result.error)
            cancel_room(bootstrap.host, bootstrap.port, bootstrap.room)
        self.submit(KVArrived(rid, result))

    def _take_mtp_state(self, req, result: KVResult) -> None:
        """With MTP: d_1, and what drafted it, from the prefill server (written into this
        request row's staging slots), as the MTP decoder keeps them after a prefill."""
        if not self.mtp or result.draft_token is None:
            return
        from srt_ascend.speculative.mtp_worker import state_of

        row, device = req.req_pool_idx, self.runner.device
        state = state_of(req)
        state.token = torch.tensor(result.draft_token, device=device)
        state.hidden = self.hidden_in[row].clone().to(device)
        state.probs = self.probs_in[row].clone().to(device) if result.draft_probs else None
