"""TokenizerManager: the asyncio side of the runtime.

Tokenizes and validates requests, hands them to the Scheduler thread as typed messages,
and turns the scheduler's per-step ReqOutputs into SGLang-shaped response dicts (cumulative
text, output_ids, meta_info), streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from srt_ascend.constrained import GrammarBackend, GrammarError, GrammarOptions, compile_worker
from srt_ascend.disaggregation.protocol import BootstrapInfo
from srt_ascend.distributed import SINGLE
from srt_ascend.managers.detokenizer import (
    DecodeState,
    StopStrings,
    hold_back_stop_prefix,
    trim_stop,
)
from srt_ascend.managers.io_struct import (
    ABORTED_BY_CLIENT,
    MAX_TOP_LOGPROBS,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    ReqOutput,
    ServingStarted,
    TokenizedGenerateReq,
)
from srt_ascend.managers.scheduler import Scheduler, start_scheduler_thread
from srt_ascend.managers.tp_ranks import (
    RankProcesses,
    build_scheduler,
    dist_init_of,
    fail_fast,
    join_group,
    load_tokenizer,
)
from srt_ascend.platforms import get_platform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How long the start waits for the grammar compiler's child to import (GrammarBackend): a
# child still importing when requests arrive takes cores from the first hundred or so steps.
GRAMMAR_START_WAIT_S = 120.0


class RequestError(ValueError):
    """A bad request: the HTTP layer answers 400 with this message; `param` names the request
    field at fault where one is (the Responses API reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServerBusyError(RuntimeError):
    """The server refuses new work (queue full, shutting down): HTTP 503 with this message."""


class LoopInbox:
    """Items handed from one thread to a callback on an asyncio loop, in order. The loop is
    woken only when nothing was queued: a wake-up writes the loop's self-pipe, and that
    write's GIL release can hand the GIL to the loop's thread in the middle of the sender's
    step; while the loop is behind, later items join the queued ones and go in the same
    callback."""

    def __init__(self, deliver: Callable[[list], None]) -> None:
        self._deliver = deliver  # runs on the loop with every item queued since the last
        self._lock = threading.Lock()
        self._queued: list = []

    def put(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        """From any thread: queues `items`, waking `loop` if nothing was queued."""
        with self._lock:
            wake = not self._queued
            self._queued.extend(items)
        if wake:
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._queued = self._queued, []
        self._deliver(items)


@dataclass
class ReqState:
    rid: str  # the client's request id
    submission: str  # the id the scheduler knows this submission by (unique per process)
    params: SamplingParams
    queue: asyncio.Queue
    decode: DecodeState
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    out_logprobs: list = field(default_factory=list)
    out_top_logprobs: list = field(default_factory=list)
    out_ids_logprobs: list = field(default_factory=list)
    in_logprobs: list | None = None
    in_top_logprobs: list | None = None
    in_ids_logprobs: list | None = None
    finished: bool = False
    stops: StopStrings | None = None  # a streamed request's stop strings (held back)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs) -> None:
        self.platform = get_platform(server_args.device)
        self.args = server_args.for_device(self.platform.name)  # per-device defaults
        self.tokenizer = load_tokenizer(server_args.tokenizer)
        # Requests in flight by the client's rid, and by submission id: the scheduler's
        # outputs are routed by the latter, so a rid reused right after its request was
        # aborted never receives the aborted submission's last outputs.
        self.states: dict[str, ReqState] = {}
        self._submissions: dict[str, ReqState] = {}
        self._submission_ids = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        # outputs from the scheduler thread not yet dispatched on the loop (_on_outputs)
        self._outputs = LoopInbox(self._dispatch)
        # --tp-size > 1: this process is rank 0; the node's other ranks are processes.
        self.dist_init = dist_init_of(self.args) if self.args.tp_size > 1 else None
        self.ranks = RankProcesses(self.args, self.dist_init, fail_fast) if self.dist_init else None
        # The grammar compiler's child imports while the model loads (GrammarBackend takes it).
        compile_worker.prespawn()
        # A fault the scheduler cannot contain ends the process with one error line (exit 1),
        # whatever the parallelism: serving on without a scheduler would hang every request.
        self.scheduler, self.thread = start_scheduler_thread(self._build_scheduler, fail_fast)
        self.runner = self.scheduler.runner
        self.context_len = self.runner.context_len
        # Tokenization runs here, off the event loop; texts that cannot fit are refused first.
        # One bound for every route that tokenizes: --max-tokenize-tokens, else the context.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.max_tokenize_tokens = self.args.max_tokenize_tokens or self.context_len
        self.max_text_chars = self.max_tokenize_tokens * _max_token_chars(self.tokenizer)
        # Grammars compile in its threads, cached by grammar (see attach_grammar).
        self.grammars = GrammarBackend(
            self.tokenizer,
            self.runner.vocab_size,
            self.scheduler.stop_checker.eos_ids,
            GrammarOptions.from_args(self.args),
        )
        # Ready (the Engine returned, the launcher's ready line, /health) only once that
        # child has imported; one that cannot start only costs the bound (grammars retry).
        if not self.grammars.wait_started(GRAMMAR_START_WAIT_S):
            logger.warning(
                "the grammar compiler did not start within %.0f s; serving on (it starts "
                "again at the first grammar request)",
                GRAMMAR_START_WAIT_S,
            )
        self.draining = False  # set at shutdown: new requests are refused (503)
        self.scheduler.submit(ServingStarted())  # idle compiles may start now

    def _build_scheduler(self) -> Scheduler:
        """Runs in the scheduler thread: joins the tensor-parallel group as rank 0 (when
        there is one), then model load, KV pools, graph capture."""
        tp = SINGLE
        if self.dist_init is not None:
            tp = join_group(self.args, self.dist_init, 0, self.platform.dist_backend)
        return build_scheduler(self.args, self.platform, self.tokenizer, self._on_outputs, tp)

    # ---- scheduler -> asyncio -----------------------------------------------------------------

    def _on_outputs(self, outputs: list[ReqOutput]) -> None:
        if self.loop is not None:
            self._outputs.put(self.loop, outputs)

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            state = self._submissions.get(out.rid)  # None: an abandoned submission's
            if state is not None:
                state.queue.put_nowait(out)

    # ---- requests -----------------------------------------------------------------------------

    def has_request(self, rid: str) -> bool:
        """Whether a request with this id is in flight (ids must be unique while running)."""
        return rid in self.states

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def tokenize_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`tokenize` in the tokenizer thread, so the event loop keeps serving (/health).
        Every route tokenizes through here, under one bound (`max_tokenize_tokens`): a text
        with more characters than that many tokens can cover is refused before tokenizing,
        one with more tokens right after (RequestError, 400), before the route's work."""
        if len(text) > self.max_text_chars:
            raise RequestError(
                f"the input ({len(text)} characters) is longer than {self.tokenize_bound()}"
            )
        ids = await self.off_loop(self.tokenize, text, add_special_tokens)
        if len(ids) > self.max_tokenize_tokens:
            raise RequestError(
                f"the input ({len(ids)} tokens) is longer than {self.tokenize_bound()}"
            )
        return ids

    def tokenize_bound(self) -> str:
        """The tokenize bound in words, for refusals."""
        if self.args.max_tokenize_tokens is None:
            return f"the model's context length ({self.context_len} tokens)"
        return f"--max-tokenize-tokens ({self.max_tokenize_tokens} tokens)"

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the tokenizer thread, so that the event loop keeps serving (/health,
        other streams) while one request's work that grows with its size (templating,
        tokenizing, validating long inputs) runs. Requests take turns in that one thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, fn, *args)

    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished (running or waiting in the scheduler)."""
        return len(self.states)

    def check_admission(self, n: int) -> None:
        """ServerBusyError (503) when `n` more requests would exceed
        --max-running-requests + --max-queued-requests, or the server is shutting down."""
        if self.draining:
            raise ServerBusyError("the server is shutting down")
        queued_limit = self.args.max_queued_requests
        if queued_limit is None:
            return
        limit = self.args.max_running_requests + queued_limit
        if self.num_in_flight() + n > limit:
            raise ServerBusyError(
                f"the request queue is full ({self.num_in_flight()} requests in flight, "
                f"--max-running-requests {self.args.max_running_requests} + "
                f"--max-queued-requests {queued_limit}); retry later"
            )

    def validate_input_ids(self, input_ids: list) -> None:
        """RequestError unless `input_ids` are token ids of this model's vocabulary."""
        vocab = self.runner.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in input_ids):
            raise RequestError(f"input_ids must be integers in [0, {vocab})")

    def _check_draft_length(self, steps: int | None) -> None:
        """RequestError (a 400) unless a request's `speculative_num_steps` is within what the
        server drafts: 0 .. --speculative-num-steps with MTP, only 0 without it."""
        if steps is None:
            return
        most = self.args.speculative_num_steps if self.args.spec_enabled else 0
        if steps > most:
            why = "the server's --speculative-num-steps" if most else "no speculative decoding"
            raise RequestError(
                f"sampling_params.speculative_num_steps must be in [0, {most}] ({why}), got {steps}"
            )

    def _checked_params(self, sampling_params: dict | None) -> SamplingParams:
        try:
            params = SamplingParams.from_dict(sampling_params or {})
            params.verify(self.runner.vocab_size)
            params.normalize()
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        self._check_draft_length(params.speculative_num_steps)
        return params

    def _check_input(self, input_ids: list[int], max_new_tokens: int) -> None:
        """The prompt is non-empty, valid ids, and it plus max_new_tokens fits the context."""
        if not input_ids:
            raise RequestError("the input is empty")
        self.validate_input_ids(input_ids)
        if len(input_ids) >= self.context_len:
            raise RequestError(
                f"the input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)"
            )
        total = len(input_ids) + max_new_tokens
        if total >= self.context_len:
            raise RequestError(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {total} tokens: "
                f"{len(input_ids)} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    @staticmethod
    def _logprob_start(num_input: int, logprob_start_len: int | None) -> int:
        """SGLang's: by default (None or -1) no prompt logprobs, only the output's."""
        start = (
            num_input if logprob_start_len is None or logprob_start_len < 0 else logprob_start_len
        )
        if start > num_input:
            raise RequestError(
                f"logprob_start_len={start} is higher than the number of input tokens "
                f"{num_input}. Please use a smaller logprob_start_len."
            )
        return start

    def make_request(
        self,
        input_ids: list[int],
        sampling_params: dict | None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        extra_key: str | None = None,
        token_ids_logprob: list[int] | None = None,
        bootstrap: BootstrapInfo | None = None,
    ) -> TokenizedGenerateReq:
        """Validates one request; raises RequestError with a user-facing message. As in
        SGLang, the prompt plus max_new_tokens must stay below the context length (nothing is
        clamped); `extra_key` (cache_salt) keeps its cached prefixes apart from other keys'."""
        params = self._checked_params(sampling_params)
        self._check_input(input_ids, params.max_new_tokens)
        if top_logprobs_num is not None and not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
        if token_ids_logprob:
            try:
                self.validate_input_ids(token_ids_logprob)
            except RequestError as e:
                raise RequestError(f"token_ids_logprob: {e}") from None
        start = -1
        if return_logprob:
            start = self._logprob_start(len(input_ids), logprob_start_len)
        return TokenizedGenerateReq(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_logprobs_num or 0,
            token_ids_logprob=list(token_ids_logprob) if token_ids_logprob else None,
            stream=stream,
            extra_key=extra_key,
            bootstrap=bootstrap,
        )

    def prefill_request(self, samples: list[TokenizedGenerateReq]) -> TokenizedGenerateReq:
        """A request that only prefills the prompt of `samples` (the parallel samples of one
        prompt: same input ids and cache salt), to run before them so that they share its
        KV through the radix cache. It has their salt (its KV is cached only where they
        look) and a routing key set on them too (under data-parallel attention they all
        run in the same group). Sets `routing_key` on `samples`."""
        key = uuid.uuid4().hex
        for r in samples:
            r.routing_key = key
        first = samples[0]
        prefill = self.make_request(
            first.input_ids, {"max_new_tokens": 0}, extra_key=first.extra_key
        )
        prefill.routing_key = key
        return prefill

    def max_new_tokens_left(self, num_input_tokens: int) -> int:
        """The longest output a prompt of this length can have (SGLang's default when a chat
        or completion request leaves max_tokens unset: generate up to the context length)."""
        return max(self.context_len - 1 - num_input_tokens, 0)

    async def attach_grammar(self, req: TokenizedGenerateReq) -> None:
        """Compiles the request's grammar (regex, json_schema, ...) off the event loop and the
        scheduler thread, or takes it from the cache, into `req.grammar`; RequestError with
        xgrammar's message if it does not compile. Nothing to do without a grammar or when
        attached already; `generate_one` calls it, routes call it first to refuse early."""
        spec = req.sampling_params.grammar_spec
        if spec is None or req.grammar is not None:
            return
        try:
            # shielded: a client that leaves must not cancel the compile other requests share
            req.grammar = await asyncio.shield(asyncio.wrap_future(self.grammars.compile(spec)))
        except GrammarError as e:
            raise RequestError(str(e)) from e

    async def generate_one(self, req: TokenizedGenerateReq) -> AsyncIterator[dict]:
        """Submits one request (once its grammar, if any, is compiled) and yields response
        dicts: one per step when streaming, else one at its first tokens (their time is a
        metric) and one at the end. Cancelling the iterator
        aborts the request; its rid is free again at once (the scheduler knows the
        submission by its own id, `ReqState.submission`)."""
        self.loop = self.loop or asyncio.get_running_loop()
        await self.attach_grammar(req)
        if req.rid in self.states:
            raise RequestError(f"duplicate request id {req.rid!r}")
        state = ReqState(
            req.rid,
            f"{req.rid}#{next(self._submission_ids)}",
            req.sampling_params,
            asyncio.Queue(),
            DecodeState(req.sampling_params.skip_special_tokens),
        )
        p = req.sampling_params
        if req.stream and p.stop and not p.no_stop_trim:
            state.stops = StopStrings.of(p.stop)
        self.states[req.rid] = state
        self._submissions[state.submission] = state
        self.scheduler.submit(dataclasses.replace(req, rid=state.submission))
        try:
            while True:
                out: ReqOutput = await state.queue.get()
                first = bool(out.new_token_ids) and state.first_token_time is None
                self._absorb(state, out, len(req.input_ids))
                if state.finished or req.stream or first:
                    resp = self._response(state, out, req)
                    if state.finished or out.new_token_ids:
                        yield resp
                if state.finished:
                    return
        finally:
            if not state.finished:
                self.scheduler.submit(AbortReq(state.submission))
            self.states.pop(req.rid, None)
            self._submissions.pop(state.submission, None)

    def _absorb(self, state: ReqState, out: ReqOutput, prompt_len: int) -> None:
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.monotonic()
        state.finished = out.finish_reason is not None
        # SGLang's trim: a matched stop token (EOS, stop_token_ids) is not in the text
        matched = (out.finish_reason or {}).get("matched")
        drop_last = isinstance(matched, int) and not state.params.no_stop_trim
        state.decode.update(self.tokenizer, out.new_token_ids, state.finished, drop_last)
        # entries take their response form once, here: a response then copies only the
        # outer lists (a step costs O(new tokens) in Python, not O(output so far))
        state.out_logprobs.extend(list(x) for x in out.output_token_logprobs)
        state.out_top_logprobs.extend(_entry_lists(out.output_top_logprobs, prompt=False))
        state.out_ids_logprobs.extend(_entry_lists(out.output_token_ids_logprobs, prompt=False))
        if out.input_token_logprobs is not None:
            state.in_logprobs = [list(x) for x in out.input_token_logprobs]
            state.in_top_logprobs = _entry_lists(out.input_top_logprobs or [])
            state.in_ids_logprobs = _entry_lists(out.input_token_ids_logprobs or [])

    def _response(self, state: ReqState, out: ReqOutput, req: TokenizedGenerateReq) -> dict:
        text = trim_stop(state.decode.text, out.stop_text, state.params.no_stop_trim)
        if not state.finished and state.stops is not None:
            text = hold_back_stop_prefix(text, state.stops)
        meta = {
            "id": state.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "e2e_latency": time.monotonic() - state.created,
        }
        if self.args.spec_enabled:
            meta["spec_verify_ct"] = out.spec_verify_ct
            meta["spec_accept_length"] = (
                out.completion_tokens / out.spec_verify_ct if out.spec_verify_ct else 0.0
            )
            # this request's drafts: verified, accepted, and per step (its k_r on average)
            meta["spec_draft_tokens"] = out.spec_draft_tokens
            meta["spec_accepted_tokens"] = out.spec_accepted_tokens
            meta["spec_draft_length"] = (
                out.spec_draft_tokens / out.spec_verify_ct if out.spec_verify_ct else 0.0
            )
        if req.return_logprob:  # the entries are shared between a request's responses
            meta["input_token_logprobs"] = list(state.in_logprobs or [])
            meta["output_token_logprobs"] = list(state.out_logprobs)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = list(state.in_top_logprobs or [])
                meta["output_top_logprobs"] = list(state.out_top_logprobs)
            if req.token_ids_logprob:
                meta["input_token_ids_logprobs"] = list(state.in_ids_logprobs or [])
                meta["output_token_ids_logprobs"] = list(state.out_ids_logprobs)
        return {"text": text, "output_ids": list(state.decode.output_ids), "meta_info": meta}

    # ---- control ------------------------------------------------------------------------------

    def abort(self, rid: str, message: str = ABORTED_BY_CLIENT) -> None:
        """Aborts the request in flight with this rid (every request with rid ""); its
        finish_reason carries `message`. An unknown rid is ignored."""
        if rid == "":
            self.scheduler.submit(AbortReq("", message))
        elif (state := self.states.get(rid)) is not None:
            self.scheduler.submit(AbortReq(state.submission, message))

    async def _ask(self, msg):
        self.scheduler.submit(msg)
        return await asyncio.wrap_future(msg.reply)

    async def flush_cache(self) -> bool:
        return await self._ask(FlushCacheReq())

    async def internal_state(self) -> dict:
        return await self._ask(GetInternalStateReq())

    def shutdown(self) -> None:
        if self.ranks is not None:
            self.ranks.announce_stop()  # their exits from here on are the stop, not a fault
        self.scheduler.stop()
        self.thread.join(timeout=10)
        if self.ranks is not None:
            self.ranks.stop()
            self.runner.tp.destroy()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.shutdown()


def _entry_lists(positions: list, prompt: bool = True) -> list:
    """Per position, its logprob entries as lists ([logprob, token_id]); a prompt position
    without entries is None (SGLang's), an output one [] (None where none were asked)."""
    return [
        [list(t) for t in x] if x or (x is not None and not prompt) else None for x in positions
    ]


def _max_token_chars(tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: twice the longest
    vocabulary entry (byte-level and sentencepiece entries are at least as long as the text
    they encode; the factor covers normalizers that shorten text)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max(longest, 1)
