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

This module is the loop (the thread API, the serial and the overlapped step); the rest of the
Scheduler lives in rooms, one mixin each, in the modules beside it:
scheduler_messages (messages, state queries, the idle self-check), scheduler_admission
(arrival, admission, prefill), scheduler_decode (decode step, commits, outputs),
scheduler_faults (aborts, retraction, a failed step's requests), scheduler_disagg (the
hooks of prefill-decode disaggregation). The class docstring says which state each writes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import srt_ascend.speculative.mtp_decoder  # noqa: F401  (registers the "MTP" decoder)
from srt_ascend.constrained import GrammarBackend
from srt_ascend.decoding import DecoderHandles, create_decoder
from srt_ascend.decoding.base import LaunchedStep, decoder_class
from srt_ascend.managers.batch_log import BatchLog
from srt_ascend.managers.io_struct import ReqOutput
from srt_ascend.managers.kv_book import KVBook
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.managers.scheduler_admission import AdmissionMixin
from srt_ascend.managers.scheduler_decode import DecodeMixin
from srt_ascend.managers.scheduler_disagg import DisaggregationMixin
from srt_ascend.managers.scheduler_faults import INTERNAL_ERROR, FaultsMixin
from srt_ascend.managers.scheduler_messages import MessagesMixin, wire_form
from srt_ascend.managers.stop_checker import StopChecker
from srt_ascend.mem_cache import ChunkCache, RadixCache
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.device_worker import DeviceWorker, InlineWorker
from srt_ascend.server_args import ServerArgs

__all__ = ["INTERNAL_ERROR", "Scheduler", "start_scheduler_thread", "wire_form"]

logger = logging.getLogger(__name__)

# Rounds of the loop without a request (each waits up to 0.5 s for a message) before a graph
# compiles: a client that sends its next request right after the last answer does not wait
# for a compile (tens of seconds per graph on CPU).
IDLE_ROUNDS_BEFORE_COMPILE = 4


class Scheduler(AdmissionMixin, DecodeMixin, FaultsMixin, DisaggregationMixin, MessagesMixin):
    """One scheduler per rank: the loop here, the rest in its rooms (one mixin each). All
    state is set in `__init__` (a room's own by an `_init_*` it calls) and lives on this
    object; a room writes only the state its docstring names:

    - the loop: `_launched` and `num_overlapped_steps` (the overlapped step in flight),
      `in_flight` (the requests of the step being run), `running` (an overlapped step's
      finished requests leave), `_stop`, `inbox`, `_graphs_to_compile`;
    - messages (`MessagesMixin`): `_serving`, the prefix cache on a flush;
    - admission (`AdmissionMixin`): `waiting`, `chunked_req`, `running` (joining after
      prefill), the prompt counters, `_grammars`;
    - decode (`DecodeMixin`): `running` (a serial decode step), `_outputs`;
    - faults (`FaultsMixin`): `waiting`, `running`, `chunked_req` (requests taken out or
      retracted), `in_flight` and `_launched` (after a fault), `num_retractions`;
    - disaggregation (`DisaggregationMixin`): `prefill_side`, `decode_side`,
      `_disagg_ended`, `running` (a decode server's request whose KV arrived).

    Set once and only read: `args`, `runner`, `tp`, `stop_checker`, `emit`, `allocator`,
    `req_to_token_pool`, `tree`, `kv`, `overlap`, `worker`, `decoder`, `batch_log`."""

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
        self._init_disaggregation(server_args, runner)

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
