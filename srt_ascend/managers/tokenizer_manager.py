"""TokenizerManager: the asyncio side of the runtime.

Tokenizes and validates requests, hands them to the Scheduler thread as typed messages,
and turns the scheduler's per-step ReqOutputs into SGLang-shaped response dicts (cumulative
text, output_ids, meta_info), streaming or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from srt_ascend.managers.detokenizer import DecodeState, trim_stop
from srt_ascend.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    ReqOutput,
    TokenizedGenerateReq,
)
from srt_ascend.managers.scheduler import Scheduler, start_scheduler_thread
from srt_ascend.managers.stop_checker import StopChecker
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A bad request: the HTTP layer answers 400 with this message."""


@dataclass
class ReqState:
    rid: str
    params: SamplingParams
    queue: asyncio.Queue
    decode: DecodeState
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    out_logprobs: list = field(default_factory=list)
    out_top_logprobs: list = field(default_factory=list)
    in_logprobs: list | None = None
    in_top_logprobs: list | None = None
    finished: bool = False


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs) -> None:
        self.platform = get_platform(server_args.device)
        self.args = server_args.for_device(self.platform.name)  # per-device defaults
        self.tokenizer = load_tokenizer(server_args.tokenizer)
        self.states: dict[str, ReqState] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.scheduler, self.thread = start_scheduler_thread(self._build_scheduler)
        self.runner = self.scheduler.runner
        self.context_len = self.runner.context_len

    def _build_scheduler(self) -> Scheduler:
        """Runs in the scheduler thread: model load, KV pools, graph capture."""
        import torch

        args = self.args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.random_seed)
        runner = ModelRunner(args, self.platform)
        eos = runner.config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        return Scheduler(args, runner, StopChecker(self.tokenizer, eos_ids), self._on_outputs)

    # ---- scheduler -> asyncio -----------------------------------------------------------------

    def _on_outputs(self, outputs: list[ReqOutput]) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            state = self.states.get(out.rid)
            if state is not None:
                state.queue.put_nowait(out)

    # ---- requests -----------------------------------------------------------------------------

    def has_request(self, rid: str) -> bool:
        """Whether a request with this id is in flight (ids must be unique while running)."""
        return rid in self.states

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def make_request(
        self,
        input_ids: list[int],
        sampling_params: dict | None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> TokenizedGenerateReq:
        """Validates one request; raises RequestError with a user-facing message."""
        try:
            params = SamplingParams.from_dict(sampling_params or {})
            params.verify(self.runner.vocab_size)
            params.normalize()
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        if not input_ids:
            raise RequestError("the input is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.runner.vocab_size for t in input_ids):
            raise RequestError(f"input_ids must be integers in [0, {self.runner.vocab_size})")
        if len(input_ids) >= self.context_len:
            raise RequestError(
                f"the input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)"
            )
        if top_logprobs_num is not None and top_logprobs_num < 0:
            raise RequestError("top_logprobs_num must be >= 0")
        start = -1
        if return_logprob:
            start = (
                len(input_ids) - 1
                if logprob_start_len is None or logprob_start_len < 0
                else logprob_start_len
            )
            if start >= len(input_ids):
                raise RequestError("logprob_start_len must be smaller than the input length")
        max_new = params.max_new_tokens
        params.max_new_tokens = min(max_new, self.context_len - len(input_ids))
        return TokenizedGenerateReq(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_logprobs_num or 0,
            stream=stream,
        )

    async def generate_one(self, req: TokenizedGenerateReq) -> AsyncIterator[dict]:
        """Submits one request and yields response dicts: one per step when streaming,
        else one at the end. Cancelling the iterator aborts the request."""
        self.loop = self.loop or asyncio.get_running_loop()
        if req.rid in self.states:
            raise RequestError(f"duplicate request id {req.rid!r}")
        state = ReqState(
            req.rid,
            req.sampling_params,
            asyncio.Queue(),
            DecodeState(req.sampling_params.skip_special_tokens),
        )
        self.states[req.rid] = state
        self.scheduler.submit(req)
        try:
            while True:
                out: ReqOutput = await state.queue.get()
                self._absorb(state, out, len(req.input_ids))
                if state.finished or req.stream:
                    resp = self._response(state, out, req)
                    if state.finished or out.new_token_ids:
                        yield resp
                if state.finished:
                    return
        finally:
            if not state.finished:
                self.abort(req.rid)
            self.states.pop(req.rid, None)

    def _absorb(self, state: ReqState, out: ReqOutput, prompt_len: int) -> None:
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.monotonic()
        state.finished = out.finish_reason is not None
        state.decode.update(self.tokenizer, out.new_token_ids, state.finished)
        state.out_logprobs.extend(out.output_token_logprobs)
        state.out_top_logprobs.extend(out.output_top_logprobs)
        if out.input_token_logprobs is not None:
            state.in_logprobs = out.input_token_logprobs
            state.in_top_logprobs = out.input_top_logprobs

    def _response(self, state: ReqState, out: ReqOutput, req: TokenizedGenerateReq) -> dict:
        text = trim_stop(state.decode.text, out.finish_reason, state.params.no_stop_trim)
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
        if req.return_logprob:
            meta["input_token_logprobs"] = [list(x) for x in (state.in_logprobs or [])]
            meta["output_token_logprobs"] = [list(x) for x in state.out_logprobs]
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    [list(t) for t in x] if x else None for x in (state.in_top_logprobs or [])
                ]
                meta["output_top_logprobs"] = [[list(t) for t in x] for x in state.out_top_logprobs]
        return {"text": text, "output_ids": list(state.decode.output_ids), "meta_info": meta}

    # ---- control ------------------------------------------------------------------------------

    def abort(self, rid: str) -> None:
        self.scheduler.submit(AbortReq(rid))

    async def _ask(self, msg):
        self.scheduler.submit(msg)
        return await asyncio.wrap_future(msg.reply)

    async def flush_cache(self) -> bool:
        return await self._ask(FlushCacheReq())

    async def internal_state(self) -> dict:
        return await self._ask(GetInternalStateReq())

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.thread.join(timeout=10)
