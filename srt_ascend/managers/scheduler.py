"""Scheduler: waiting queue -> prefill (chunked) -> continuous decode batch -> outputs.

Runs in its own thread. Talks to the API layer only through io_struct messages: requests come
in through `submit`, per-step ReqOutputs go out through the `emit` callback.

Under tensor parallelism every rank runs one Scheduler; only the leader's (rank 0) gets
messages through `submit`, and at the top of each loop it broadcasts those it took (`_receive`),
so every rank handles the same messages at the same point and then runs the same step.

Overlap scheduling (the default with one rank where the platform gains by it, that is on an
accelerator or with compiled forwards on CPU: `Platform.overlaps_by_default`;
`--disable-overlap-schedule` gives the serial loop, `--enable-overlap-schedule` forces it): in
a decode phase the scheduler launches step N+1 (`Decoder.launch`, its inputs step N's tokens
still on the device) before it finishes step N (`Decoder.finish`: the host read, commits, stop
checks, releases, outputs), so that host work runs while the device computes. Everything else
(a prefill, a retraction, a batch the decoder cannot overlap, a graph compile) first finishes
the step in flight and then runs serially, as without overlap; so does everything while tokens
are waiting to be admitted. The device work runs on the platform's DeviceWorker
(`platforms/device_worker.py`): inline on CUDA/NPU, a thread on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

import srt_ascend.speculative.mtp_decoder  # noqa: F401  (registers the "MTP" decoder)
from srt_ascend.constrained import Grammar, GrammarBackend, GrammarOptions
from srt_ascend.decoding import DecoderHandles, create_decoder
from srt_ascend.decoding.base import LaunchedStep, decoder_class
from srt_ascend.disaggregation.protocol import (
    DestinationArrived,
    KVArrived,
    KVLate,
    KVResult,
    RoomCancelled,
    RoomExpired,
    TransferDone,
)
from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.managers.batch_log import BatchLog, PoolUsage
from srt_ascend.managers.io_struct import (
    ABORTED_BY_CLIENT,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    ReqOutput,
    ServingStarted,
    TokenizedGenerateReq,
)
from srt_ascend.managers.kv_book import KVBook
from srt_ascend.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from srt_ascend.managers.schedule_policy import (
    DECODE_RESERVE_PER_REQ,
    PrefillAdder,
    order_waiting,
)
from srt_ascend.managers.stop_checker import StopChecker
from srt_ascend.mem_cache import ChunkCache, RadixCache
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.device_worker import DeviceWorker, InlineWorker
from srt_ascend.sampling.sample_step import input_logprobs
from srt_ascend.server_args import ServerArgs
from srt_ascend.utils import to_device

logger = logging.getLogger(__name__)

# Rounds of the loop without a request (each waits up to 0.5 s for a message) before a graph
# compiles: a client that sends its next request right after the last answer does not wait
# for a compile (tens of seconds per graph on CPU).
IDLE_ROUNDS_BEFORE_COMPILE = 4
# The finish message of a request that a contained fault (in a step or a message) ended.
INTERNAL_ERROR = "internal error in the scheduler (see server log)"


class Scheduler:
    def __init__(
        self, server_args: ServerArgs, runner: ModelRunner, stop_checker: StopChecker, emit
    ) -> None:
        self.args = server_args
        self.runner = runner
        self.tp = runner.tp
        self.stop_checker = stop_checker
        self.emit = emit  # Callable[[list[ReqOutput]], None], called from the scheduler thread
        self.allocator = runner.allocator
        self.req_to_token_pool = runner.req_to_token_pool
        if server_args.disable_radix_cache:
            self.tree = ChunkCache(self.allocator)
        else:
            self.tree = RadixCache(self.allocator, bigram_keys=server_args.spec_enabled)
        self.kv = KVBook(self.allocator, self.req_to_token_pool, self.tree, self._retract)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.in_flight: list[Req] = []  # the requests of the step being run
        self.inbox: queue.Queue = queue.Queue()
        # overlap scheduling: where the platform gains by it (or forced on), with one rank
        # (the ranks of a group agree on each step's tokens before it commits, serially) and
        # a decoder that splits its steps
        self.overlap = (
            not server_args.disable_overlap_schedule
            and (
                server_args.enable_overlap_schedule
                or runner.platform.overlaps_by_default(server_args)
            )
            and self.tp.size == 1
            and decoder_class(server_args).overlaps
        )
        self.worker: DeviceWorker = (
            runner.platform.new_device_worker() if self.overlap else InlineWorker()
        )
        self._launched: LaunchedStep | None = None  # the decode step in flight (overlap)
        self.num_overlapped_steps = 0  # decode steps launched before the previous one's read
        self.decoder = create_decoder(
            server_args,
            DecoderHandles(runner, self.kv, self._commit, stop_checker.eos_ids, self.worker),
        )
        runner.capture_graphs(self.decoder.graph_kinds())
        self.decoder.calibrate()
        self._graphs_to_compile = True  # until compile_next_graph says none is left
        self._serving = False  # idle compiles wait for ServingStarted (the server is ready)
        self.num_retractions = 0
        self.total_cached_tokens = 0
        self.total_prompt_tokens = 0
        self.batch_log = BatchLog(server_args.decode_log_interval, server_args.spec_enabled)
        self._outputs: list[ReqOutput] = []  # filled by commits during a step
        self._stop = threading.Event()
        self._grammars: GrammarBackend | None = None  # ranks other than the leader compile here
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

    # ---- thread API -------------------------------------------------------------------------

    def submit(self, msg) -> None:
        self.inbox.put(msg)

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        for side in (self.prefill_side, self.decode_side):
            if side is not None:
                side.close()

    def run_forever(self) -> None:
        """Runs until `stop` (on the leader; the other ranks stop when it broadcasts so).
        Under tensor parallelism a failed step raises: the ranks would no longer agree.
        Once it has had no request for IDLE_ROUNDS_BEFORE_COMPILE rounds of the loop, it
        compiles the queued graphs (--enable-torch-compile; once the server is ready:
        `ServingStarted`, broadcast to the other ranks), one per round, so messages are
        read between two; counting rounds, not seconds, keeps tensor-parallel ranks in step."""
        idle_rounds = 0
        while self._receive(block=not self.has_work()):
            self._poll_disaggregation()
            # idle rounds count from the server's ready (ServingStarted) on
            idle_rounds = 0 if self.has_work() or not self._serving else idle_rounds + 1
            if idle_rounds >= IDLE_ROUNDS_BEFORE_COMPILE and self._graphs_to_compile:
                self._compile_one_graph()
            if not self.has_work():
                continue
            try:
                worked = self.step()
            except Exception:  # a bug must not kill the server: fail the step's requests
                if self.tp.size > 1:
                    raise
                logger.exception("scheduler step failed; aborting its requests")
                self._fail_in_flight(INTERNAL_ERROR)
                worked = True
            if worked and not self.has_work():
                self._check_when_idle()

    def _compile_one_graph(self) -> None:
        """One queued graph compiled and swapped in (every rank at the same point of the
        loop: its warm-up forwards are collective under tensor parallelism). A failed
        compile leaves that graph uncompiled; under tensor parallelism it raises."""
        try:
            self._graphs_to_compile = self.worker.run(self.runner.compile_next_graph)
        except Exception:
            if self.tp.size > 1:
                raise
            logger.exception("torch.compile of a graph failed; it stays uncompiled")

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

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req) or self._launched is not None

    def _receive(self, block: bool) -> bool:
        """Handles the messages that arrived (waiting up to 0.5 s for one when `block`);
        False once the scheduler is stopped. The leader of a tensor-parallel group broadcasts
        them, and whether it stops, to the other ranks, which take theirs from it (idle, the
        leader still broadcasts every 0.5 s: the other ranks wait in that broadcast)."""
        msgs = self._take_inbox(block) if self.tp.is_leader else []
        if self.tp.size > 1:
            stop, wire = self.tp.broadcast_object((self._stop.is_set(), wire_form(msgs)))
            if not self.tp.is_leader:
                msgs = wire
            if stop:
                self._stop.set()
        self.handle_all(msgs)
        return not self._stop.is_set()

    def _take_inbox(self, block: bool) -> list:
        msgs = []
        try:
            msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if msg is not None:  # None: `stop`'s wake-up
                    msgs.append(msg)
                msg = self.inbox.get_nowait()
        except queue.Empty:
            return msgs

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

    def _add_request(self, m: TokenizedGenerateReq) -> None:
        req = Req(
            m.rid,
            list(m.input_ids),
            m.sampling_params,
            m.return_logprob,
            m.logprob_start_len,
            m.top_logprobs_num,
            m.token_ids_logprob,
            m.stream,
            extra_key=m.extra_key,
            grammar=self._grammar_of(m),
            bootstrap=m.bootstrap,
        )
        limit = self.runner.context_len
        if len(req.origin_input_ids) >= limit:
            self._finish(
                req,
                FinishReason(
                    "abort",
                    message=(
                        f"the prompt has {len(req.origin_input_ids)} tokens, the context length is "
                        f"{limit}"
                    ),
                ),
            )
            return
        if len(req.origin_input_ids) + self.kv.page_size > self.runner.max_total_tokens:
            self._finish(req, FinishReason("abort", message="the prompt does not fit the KV pool"))
            return
        if req.bootstrap is not None and self.decode_side is not None:
            self.decode_side.add(req)  # its KV comes from its prefill server
            return
        if req.bootstrap is not None and self.prefill_side is not None:
            if self.prefill_side.room_taken(req.bootstrap.room):
                message = f"bootstrap_room {req.bootstrap.room} is in use by another request"
                self._finish(req, FinishReason("abort", message=message))
                return
            self.prefill_side.add(req)
        self.waiting.append(req)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Runs one prefill or decode batch; False when there was nothing to run (the loop
        then checks the idle invariant only after a step that ran). With overlap, a decode
        step is launched and the one before it finished (`_overlap_step`)."""
        if self.overlap:
            return self._overlap_step()
        return self._serial_step()

    def _overlap_step(self) -> bool:
        """Launches the running batch's next decode step, then finishes the one in flight.
        When it cannot launch (requests waiting for admission or a chunk to prefill, a batch
        the decoder runs serially, KV that does not fit without retracting), it finishes the
        step in flight and runs `_serial_step` on the device worker: prefills, retractions
        and serial batches see exactly the state they would without overlap."""
        self.in_flight = list(self.running)
        launched = None
        reqs = self.running
        if reqs and not self.waiting and self.chunked_req is None:
            if self.decoder.can_overlap(reqs):
                launched = self.decoder.launch(reqs, self._launched)
        if launched is None:
            finished = self._finish_launched()
            worked = self.worker.run(self._serial_step)
            self.in_flight = []
            return finished or worked
        previous, self._launched = self._launched, launched
        if previous is not None:
            self.num_overlapped_steps += 1
            self._finish_step(previous)
        if not self.running:
            # every request of the step just launched has finished: finish it now, so the
            # loop is idle (a cache flush right after the last output is not refused)
            self._finish_launched()
        self.in_flight = []
        return True

    def _finish_launched(self) -> bool:
        """Finishes the step in flight, if any (nothing is launched after it)."""
        step, self._launched = self._launched, None
        if step is None:
            return False
        self._finish_step(step)
        return True

    def _finish_step(self, step: LaunchedStep) -> None:
        """A launched step's commits; the requests it finished are released, each first
        rolled back to its start in the step launched after it (that step's token is dropped,
        its KV position freed)."""
        before = {id(r): len(r.output_ids) for r in step.reqs}
        stepped = self.decoder.finish(step)
        if stepped:
            new_tokens = sum(len(r.output_ids) - before[id(r)] for r in stepped)
            self.batch_log.decode(len(stepped), new_tokens, self._pool_usage(), len(self.waiting))
        done = [r for r in stepped if r.finished]
        for r in done:
            self._roll_back(r)
            self.kv.release(r)
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
        self._flush_outputs()

    def _roll_back(self, req: Req) -> None:
        """A request leaving while a launched step holds it: its KV is valid only up to that
        step's start (the step's write lands later, into a slot its release frees)."""
        if self._launched is not None:
            start = self._launched.start_of(req)
            if start is not None and req.req_pool_idx is not None:
                req.kv_len = min(req.kv_len, start)

    def _serial_step(self) -> bool:
        """`step` without overlap."""
        batch = self._schedule_prefill()
        if batch is not None:
            self.in_flight = batch.reqs
            self._run_prefill(batch)
        elif self.running:
            self.in_flight = self.running
            self._run_decode()
        else:
            return False
        self.in_flight = []
        return True

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        chunk = self.args.chunked_prefill_size
        adder = PrefillAdder(
            budget=chunk if chunk > 0 else 1 << 62,
            available=self.allocator.available_size() + self.tree.evictable_size(),
            free_req_slots=self.args.max_running_requests - len(self.running),
            page_size=self.kv.page_size,
            reserve=sum(min(r.remaining_new_tokens, DECODE_RESERVE_PER_REQ) for r in self.running),
        )
        if self.chunked_req is not None:
            # It takes one of the --max-running-requests places (it holds its row since its
            # first chunk), so running + chunked + admitted stays within the limit and the
            # decode batch after it within the largest graph bucket.
            r = self.chunked_req
            if not adder.try_add(r, r.seq_len - r.kv_len, can_chunk=True):
                return None
        for req in order_waiting(self.waiting, self.args.schedule_policy, self.tree):
            if not self._admit(req, adder):
                break
        plan = adder.plan
        if not plan.reqs:
            return None
        admitted = {id(r) for r in plan.reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.batch_log.prefill(
            len(plan.reqs),
            sum(plan.extend_lens),
            sum(r.kv_len for r in plan.reqs if r is not self.chunked_req),
            self._pool_usage(),
            len(self.running),
            len(self.waiting),
        )
        return ScheduleBatch(plan.reqs, ForwardMode.EXTEND, plan.extend_lens, plan.chunked)

    def _admit(self, req: Req, adder: PrefillAdder) -> bool:
        """Matches the prefix, locks it, and asks the adder; undoes everything on refusal."""
        match = self.tree.match_prefix(req.all_ids[: req.max_prefix_len()], req.extra_key)
        # Locking makes the matched nodes unevictable: the adder's budget shrinks with them.
        adder.available += self.tree.inc_lock_ref(match.last_node)
        can_chunk = self.chunked_req is None and not adder.plan.chunked
        if not adder.try_add(req, req.seq_len - match.prefix_len, can_chunk):
            adder.available += self.tree.dec_lock_ref(match.last_node)
            return False
        rows = self.req_to_token_pool.alloc(1)
        assert rows is not None, "request rows are sized by --max-running-requests"
        req.req_pool_idx = rows[0]
        req.prefix_len = req.kv_len = req.alloc_len = match.prefix_len
        req.last_node = match.last_node
        req.cached_tokens = match.prefix_len if not req.retracted else req.cached_tokens
        self.req_to_token_pool.write(
            [req.req_pool_idx], [0], match.device_indices, [match.prefix_len]
        )
        return True

    # ---- prefill ----------------------------------------------------------------------------

    def _run_prefill(self, batch: ScheduleBatch) -> None:
        reqs, lens = batch.reqs, batch.extend_lens
        loc = self.kv.alloc_extend(reqs, lens)
        input_ids = []
        for r, n in zip(reqs, lens):
            input_ids.extend(r.all_ids[r.kv_len : r.kv_len + n])
        fb = self.runner.build_forward_batch(
            ForwardMode.EXTEND,
            input_ids,
            [r.req_pool_idx for r in reqs],
            [r.kv_len + n for r, n in zip(reqs, lens)],
            lens,
            loc,
        )
        hidden = self.runner.forward(fb)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        kv_before = [r.kv_len for r in reqs]
        for r, n, s in zip(reqs, lens, starts):
            if r.wants_input_logprobs:
                self._collect_input_logprobs(r, hidden[s : s + n], r.kv_len)
            r.kv_len += n
        for r in reqs:
            if r.rid in batch.chunked:
                self._cache_chunk(r)
        self.chunked_req = next((r for r in reqs if r.rid in batch.chunked), None)
        done = [r.rid not in batch.chunked for r in reqs]
        to_sample, prompt_only = [], []
        for r, d, s, n in zip(reqs, done, starts, lens):
            if not d:
                continue
            if r.sampling_params.max_new_tokens == 0:  # e.g. prompt logprobs only
                r.finished_reason = FinishReason("length", length=0)
                prompt_only.append(r)
                continue
            to_sample.append((r, s + n - 1))
            self.total_prompt_tokens += len(r.origin_input_ids)
            self.total_cached_tokens += r.cached_tokens
        if to_sample:
            last = to_device([i for _, i in to_sample], hidden.device)  # no blocking copy
            logits = self.runner.compute_logits(hidden.index_select(0, last))
            self.decoder.sample_and_commit([r for r, _ in to_sample], logits)
        joining = [r for r, _ in to_sample if not r.finished]
        self.decoder.after_prefill(reqs, kv_before, lens, hidden, done, self._next_batch(joining))
        # a prefill server's requests go to their decode server, KV and all
        sent = set()
        if self.prefill_side is not None:
            sent = {id(r) for r, d in zip(reqs, done) if d and r.bootstrap is not None}
        for r in reqs:
            if r.finished and id(r) not in sent:
                self.kv.release(r)
        self._outputs += [self._make_output(r) for r in prompt_only if id(r) not in sent]
        self.running.extend(r for r in joining if id(r) not in sent)
        self._flush_outputs()
        for r in reqs:
            if id(r) in sent:
                self.prefill_side.prefilled(r)

    def _collect_input_logprobs(self, req: Req, hidden: torch.Tensor, a: int) -> None:
        """Positions a..a+n-1 were computed; the logits at q give the logprob of token q+1."""
        start, prompt = req.logprob_start_len, req.origin_input_ids
        if start == 0 and a == 0:
            req.input_token_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        lo, hi = max(start - 1, a, 0), min(a + hidden.shape[0], len(prompt) - 1)
        if hi > lo:
            logits = self.runner.compute_logits(hidden[lo - a : hi - a])
            asked = req.token_ids_logprob
            lps = input_logprobs(logits, prompt[lo + 1 : hi + 1], req.top_logprobs_num, asked)
            req.input_token_logprobs.extend(zip(lps.chosen, prompt[lo + 1 : hi + 1]))
            req.input_top_logprobs.extend(lps.top)
            req.input_token_ids_logprobs.extend(_with_ids(v, asked) for v in lps.ids)

    def _grammar_of(self, m: TokenizedGenerateReq) -> Grammar | None:
        """The request's grammar matcher. The leader gets requests with the grammar compiled
        (TokenizerManager.attach_grammar); the other ranks of a tensor-parallel group get them
        without (xgrammar's compiled grammars do not pickle) and compile the same grammar
        here, from their own cache, as each SGLang rank compiles its own."""
        spec = m.sampling_params.grammar_spec
        if spec is None:
            return None
        compiled = m.grammar
        if compiled is None:
            if self._grammars is None:
                self._grammars = GrammarBackend(
                    self.stop_checker.tokenizer,
                    self.runner.vocab_size,
                    self.stop_checker.eos_ids,
                    GrammarOptions.from_args(self.args, bounded=False),
                )
            compiled = self._grammars.compile(spec).result()
        return Grammar(compiled)

    def _cache_chunk(self, req: Req) -> None:
        row = self.req_to_token_pool.host[req.req_pool_idx, : req.kv_len].clone()
        res = self.tree.cache_unfinished_req(
            req.all_ids, row, req.prefix_len, req.last_node, req.extra_key
        )
        self.req_to_token_pool.write([req.req_pool_idx], [0], res.device_indices, [res.prefix_len])
        req.prefix_len, req.last_node = res.prefix_len, res.last_node

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
        then whenever N or more wait (a speculative step may commit several); its last output
        (finish or abort) carries whatever waits."""
        if not req.pending_ids:
            return False
        first = len(req.output_ids) == len(req.pending_ids)
        return first or len(req.pending_ids) >= self.args.stream_interval

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

    def _forget_room(self, reqs: list[Req]) -> None:
        """Prefill server: these requests ended here (sent, failed or aborted): their rooms
        are free, and a registration still to come for one is answered at once. (A request
        whose first token finished it is not ended by that: it is still to be sent.)"""
        if self.prefill_side is not None:
            for r in reqs:
                if r.bootstrap is not None:
                    self.prefill_side.forget(r)

    # ---- abort / flush / state --------------------------------------------------------------

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

    def _emit(self, outputs: list[ReqOutput]) -> None:
        if outputs:
            self.emit(outputs)


def _with_ids(values: list[float], asked: list[int] | None) -> list[tuple[float, int]] | None:
    """One position's token_ids_logprob entry: (logprob, id) per asked id, in asked order."""
    return list(zip(values, asked)) if asked else None


def _top(entries: list | None) -> list | None:
    """A top-logprobs list read back from JSON: its (logprob, token id) pairs as tuples."""
    return None if entries is None else [tuple(e) for e in entries]


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


def start_scheduler_thread(
    build: Callable[[], Scheduler], on_crash: Callable[[str], None] | None = None
) -> tuple[Scheduler, threading.Thread]:
    """Builds the scheduler (model load, pools, graphs) inside its own thread and runs it there;
    returns it once built, or raises what building raised. `on_crash(message)` is called if
    the loop itself raises (a fault it cannot contain: the server cannot go on).

    All tensor work then happens in one thread (with overlap on CPU the scheduler's loop moves
    to a second thread, and this one runs the device worker's closures). On CPU this matters:
    a second thread with its own OpenMP team (the main thread's, had the model been loaded
    there) makes libgomp throttle its spin-waits once more threads than cores exist, and every
    small op then pays a worker wake-up; decode steps measured twice as slow that way."""
    built: Future[Scheduler] = Future()

    def main() -> None:
        try:
            scheduler = build()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises
            built.set_exception(e)
            return
        built.set_result(scheduler)
        worker = scheduler.worker
        if not worker.needs_serving_thread:
            loop(scheduler)
            return
        # overlap on CPU: this thread, which loaded the model, runs every forward; the loop
        # moves to a thread of its own
        worker.claim()
        threading.Thread(
            target=loop, args=(scheduler,), name="srt-scheduler-loop", daemon=True
        ).start()
        worker.serve()

    def loop(scheduler: Scheduler) -> None:
        try:
            scheduler.run_forever()
        except BaseException as e:
            if on_crash is None:
                raise
            logger.exception("the scheduler failed")
            on_crash(f"the scheduler stopped: {type(e).__name__}: {e}")
        finally:
            scheduler.worker.close()

    t = threading.Thread(target=main, name="srt-scheduler", daemon=True)
    t.start()
    return built.result(), t
