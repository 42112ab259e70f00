"""What the native and OpenAI routes share: one way to run requests through the
TokenizerManager with their latency metrics recorded, to run several at once (a batch, or
OpenAI's n), and to stop them when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from srt_ascend.entrypoints.token_bytes import TokenBytes
from srt_ascend.managers.io_struct import TokenizedGenerateReq
from srt_ascend.managers.tokenizer_manager import RequestError, ServerBusyError, TokenizerManager
from srt_ascend.metrics import RequestStats, ServerMetrics
from srt_ascend.server_args import ServerArgs

DISCONNECT_POLL_S = 0.5
DEFAULT_MODEL_NAME = "default"  # SGLang's `model` when a request names none


def served_model_names(args: ServerArgs) -> frozenset[str]:
    """The names a request's `model` may give this server's model: --served-model-name, the
    model path and its last component, and SGLang's default name (a request naming none)."""
    path = args.model_path.rstrip("/")
    names = {args.model_name, path, os.path.basename(path), DEFAULT_MODEL_NAME}
    return frozenset(n for n in names if n)


class ClientDisconnected(Exception):
    """The HTTP client left before its (non-streaming) answer; its requests were aborted."""


class Serving:
    """Holds the tokenizer manager, the server args and the metrics for the routes."""

    def __init__(self, tokenizer_manager: TokenizerManager, server_args: ServerArgs) -> None:
        self.tm = tokenizer_manager
        self.args = server_args
        self.metrics = ServerMetrics(server_args.model_name, server_args.spec_enabled)
        self.model_names = served_model_names(server_args)  # what a request's `model` may say

    # ---- building requests --------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """RequestError (400, SGLang's words) unless `model` names the served model
        (`model_names`); SGLang's `name:adapter` names a LoRA adapter, which this
        server does not serve."""
        names = self.model_names
        if model in names:
            return
        base, _, adapter = model.partition(":")
        if adapter and base in names:
            raise RequestError(
                f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled: this "
                "server serves no adapters",
                param="model",
            )
        raise RequestError(
            f"The model `{model}` does not exist. The served model name is "
            f"`{self.args.model_name}`.",
            param="model",
        )

    def make_request(
        self, input_ids: list[int], sampling_params: dict, stream: bool = True, **kw: Any
    ):
        """TokenizerManager.make_request; raises RequestError for a bad request or a rid in
        use. `stream`: whether the client streams (else the scheduler sends the request's
        outputs between its first and its last only every FORCE_STREAM_INTERVAL tokens;
        `run` sees the first tokens' time either way)."""
        rid = kw.get("rid")
        if rid is not None and self.tm.has_request(rid):
            raise RequestError(f"duplicate request id {rid!r}")
        mode = self.args.disaggregation_mode
        if mode != "null" and kw.get("bootstrap") is None:
            raise RequestError(
                f"this is a {mode} server (--disaggregation-mode {mode}): a request needs "
                "bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                "sglang-router --pd-disaggregation)"
            )
        return self.tm.make_request(input_ids, sampling_params, stream=stream, **kw)

    def check_prompt_count(self, n: int) -> None:
        """RequestError (HTTP 400) when one request asks for more than
        --max-prompts-per-request generations (prompts of a batch times n): checked before
        anything is tokenized or queued, so that no body keeps the server busy for long."""
        limit = self.args.max_prompts_per_request
        if n > limit:
            raise RequestError(
                f"the request asks for {n} generations (prompts x n); at most {limit} are "
                "allowed per request (--max-prompts-per-request)"
            )

    def admit(self, n: int) -> None:
        """Admission control before `n` requests of one HTTP request start: RequestError
        (400) past --max-prompts-per-request (`check_prompt_count`), ServerBusyError (HTTP
        503, counted in /metrics) when the queue is full or the server is shutting down."""
        self.check_prompt_count(n)
        try:
            self.tm.check_admission(n)
        except ServerBusyError:
            self.metrics.observe_rejected()
            raise

    def check_unique_rids(self, reqs: list[TokenizedGenerateReq]) -> None:
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise RequestError("request ids in one batch must be distinct")

    async def attach_grammars(self, reqs: list[TokenizedGenerateReq]) -> None:
        """Compiles the requests' grammars (cached, off the event loop): RequestError (400)
        with xgrammar's message for one that does not compile, before anything runs or
        streams."""
        await asyncio.gather(*(self.tm.attach_grammar(r) for r in reqs))

    async def cache_prompts(self, reqs: list[TokenizedGenerateReq], n: int) -> None:
        """Prefills each prompt once, so that its `n` parallel samples find it in the radix
        cache and share its KV instead of each computing it (SGLang's way with n > 1). `reqs`
        are the samples, prompt-major (n per prompt). Each prompt's prefill (a
        max_new_tokens=0 request) carries its samples' cache salt, so it is cached where they
        look and nowhere else, and a routing key it shares with them, so that under
        data-parallel attention they all run in one group's cache. Not counted in the request
        metrics."""
        prefills = [self.tm.prefill_request(reqs[i : i + n]) for i in range(0, len(reqs), n)]
        tasks = [asyncio.ensure_future(_drain(self.tm.generate_one(r))) for r in prefills]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def probe_generation(self) -> None:
        """One greedy token from the BOS token through the whole runtime (/health_generate's
        probe; not counted in the request metrics)."""
        bos = self.tm.tokenizer.bos_token_id
        req = self.tm.make_request(
            [bos if bos is not None else 0], {"max_new_tokens": 1, "temperature": 0}
        )
        await _drain(self.tm.generate_one(req))

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tm.tokenizer)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (SGLang's text in logprob entries), through a cache
        of the vocabulary's texts (responses with top logprobs name many tokens, on the
        event loop)."""
        cache = self._token_text_cache
        for i in ids:
            if i not in cache:
                cache[i] = self.tm.tokenizer.decode([i])
        return [cache[i] for i in ids]

    @functools.cached_property
    def _token_text_cache(self) -> dict[int, str]:
        return {}  # at most one entry per vocabulary id

    # ---- running requests ---------------------------------------------------------------------

    async def run(self, req: TokenizedGenerateReq, stream: bool = True) -> AsyncIterator[dict]:
        """Yields the response dicts of one request: every step when `stream`, else only the
        last. Closing the iterator early aborts the request (its KV is freed)."""
        start = time.monotonic()
        first: float | None = None
        last: dict | None = None
        gen = self.tm.generate_one(req)
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    last = out
                    if first is None and out["output_ids"]:
                        first = time.monotonic()
                    if stream or out["meta_info"]["finish_reason"] is not None:
                        yield out
        finally:
            self._record(req, last, start, first)

    def _record(
        self, req: TokenizedGenerateReq, last: dict | None, start: float, first: float | None
    ) -> None:
        meta = last["meta_info"] if last is not None else {}
        reason = meta.get("finish_reason")
        self.metrics.observe_request(
            RequestStats(
                prompt_tokens=meta.get("prompt_tokens", len(req.input_ids)),
                completion_tokens=meta.get("completion_tokens", 0),
                cached_tokens=meta.get("cached_tokens", 0),
                e2e_latency=time.monotonic() - start,
                ttft=None if first is None else first - start,
                aborted=reason is None or reason.get("type") == "abort",
                spec_verify_ct=meta.get("spec_verify_ct", 0),
                spec_draft_tokens=meta.get("spec_draft_tokens", 0),
            )
        )

    async def run_to_end(self, req: TokenizedGenerateReq) -> dict:
        last = None
        async for out in self.run(req, stream=False):
            last = out
        assert last is not None, "generate_one ended without a final output"
        return last

    async def run_all(self, reqs: list[TokenizedGenerateReq]) -> list[dict]:
        """Final outputs of all requests, in order; cancelling this aborts every one."""
        tasks = [asyncio.ensure_future(self.run_to_end(r)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream_all(self, reqs: list[TokenizedGenerateReq]) -> AsyncIterator[tuple[int, dict]]:
        """(index, output) for every step of every request, in arrival order
        (`merge_streams`); leaving early aborts every request."""
        async with contextlib.aclosing(merge_streams([self.run(r) for r in reqs])) as merged:
            async for item in merged:
                yield item

    # ---- server state -------------------------------------------------------------------------

    async def internal_state(self) -> dict:
        """The scheduler's state plus `avg_spec_accept_length` (None when MTP is off)."""
        state = await self.tm.internal_state()
        return {**state, "avg_spec_accept_length": self.metrics.avg_spec_accept_length}

    def server_info(self) -> dict:
        """The server args with their secrets redacted (`ServerArgs.redacted`), plus sizes
        (the weights' bytes as loaded: `models.weight_memory`)."""
        info = self.args.redacted()
        info.update(
            served_model_name=self.args.model_name,
            tokenizer_path=self.args.tokenizer,
            max_total_num_tokens=self.tm.runner.max_total_tokens,
            max_req_input_len=self.tm.context_len - 1,
            context_length=self.tm.context_len,
            **self.tm.runner.weight_memory,
        )
        return info


async def _drain(gen: AsyncIterator) -> None:
    async for _ in gen:
        pass


async def until_disconnected(request: Request, work: Awaitable):
    """Awaits `work`; if the HTTP client disconnects first, cancels it (aborting its
    requests) and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected(f"{request.method} {request.url.path}")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(index, output) for every output of every stream, in arrival order. One stream (the
    usual request) is iterated directly: no task per step. Several: one task per stream
    feeds a shared queue, so each output costs the same whatever their number (waiting on
    every stream's next output at once would cost their number per output). A stream's
    exception is raised in order; leaving early closes every stream (a request's aborts)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    outputs: asyncio.Queue = asyncio.Queue()
    done = object()  # a stream's end marker

    async def feed(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async with contextlib.aclosing(stream) as gen:
                async for out in gen:
                    outputs.put_nowait((i, out))
            outputs.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - raised to the consumer, in order
            outputs.put_nowait((i, e))
        except asyncio.CancelledError as e:  # the stream's own (it awaited a cancelled
            outputs.put_nowait((i, e))  # future) ends the merge too, or ours: unread
            raise

    tasks = [asyncio.ensure_future(feed(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, out = await outputs.get()
            if out is done:
                left -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# meta_info keys holding a logprob entry per position, and those holding a list of entries
# per position (a prompt position without entries: None)
ENTRY_KEYS = ("input_token_logprobs", "output_token_logprobs")
PER_POSITION_KEYS = (
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def sglang_logprob_entries(
    out: dict, token_texts: Callable[[list[int]], list[str]] | None = None
) -> dict:
    """`out` with SGLang's logprob entries, [logprob, token_id, text]: text None unless
    `token_texts` is given (return_text_in_logprobs; sglang.Engine never takes it). New
    lists replace the entries (a request's responses share them)."""
    meta = out["meta_info"]

    def entries(items: list | None) -> list | None:
        if items is None:
            return None
        texts = token_texts([e[1] for e in items]) if token_texts else [None] * len(items)
        return [[e[0], e[1], t] for e, t in zip(items, texts)]

    for key in ENTRY_KEYS:
        if key in meta:
            meta[key] = entries(meta[key])
    for key in PER_POSITION_KEYS:
        if key in meta:
            meta[key] = [entries(x) for x in meta[key]]
    return out
