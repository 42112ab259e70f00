"""Engine: the in-process API, like sglang.Engine.

engine = Engine(model_path=...)            # defaults to the shipped checkpoint
out = engine.generate("def f(", {"max_new_tokens": 16, "temperature": 0})
outs = engine.generate(["a", "b"], {"max_new_tokens": 8})
engine.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from srt_ascend.entrypoints.generate_input import (
    clean_sampling_params,
    parallel_samples,
    pop_n,
)
from srt_ascend.entrypoints.generate_input import extra_key as extra_key_of
from srt_ascend.entrypoints.serving import merge_streams, sglang_logprob_entries
from srt_ascend.managers.tokenizer_manager import TokenizerManager
from srt_ascend.server_args import ServerArgs


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs(**kwargs)
        self.tokenizer_manager = TokenizerManager(self.server_args)
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="srt-engine-loop"
        )
        self._loop_thread.start()
        self._run(self._bind_loop())

    async def _bind_loop(self) -> None:
        self.tokenizer_manager.loop = asyncio.get_running_loop()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _on_engine(self, coro) -> asyncio.Future:
        """`coro` run on the Engine's loop, awaitable from the caller's event loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        *,
        cache_salt: str | None = None,
        extra_key: str | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> one dict; a list -> a list of dicts, in order, run concurrently.
        `sampling_params` "n" > 1 (the same for every prompt) -> n samples of each prompt, a
        list in prompt-major order, as /generate answers (a seed becomes one per sample).
        `stream=True` -> an iterator of every step's dict (cumulative text; with several
        generations each carries its "index"), as sglang.Engine; leaving it early aborts
        them. Logprob entries are SGLang's [logprob, token_id, None]."""
        reqs, prefills, single = self._requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, token_ids_logprob, rid, extra_key_of(cache_salt, extra_key), stream,
        )  # fmt: skip
        if stream:
            return self._stream(reqs, prefills, single)
        if prefills:
            self._run(self._gather(prefills))
        outs = [sglang_logprob_entries(o) for o in self._run(self._gather(reqs))]
        return outs[0] if single else outs

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        *,
        cache_salt: str | None = None,
        extra_key: str | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio callers (any event loop: the work runs on the Engine's):
        the outputs, or with `stream=True` an async iterator of them."""
        reqs, prefills, single = self._requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, token_ids_logprob, rid, extra_key_of(cache_salt, extra_key), stream,
        )  # fmt: skip
        if stream:
            return self._async_stream(reqs, prefills, single)
        if prefills:
            await self._on_engine(self._gather(prefills))
        outs = [sglang_logprob_entries(o) for o in await self._on_engine(self._gather(reqs))]
        return outs[0] if single else outs

    def _requests(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        token_ids_logprob,
        rid,
        key,
        stream,
    ) -> tuple[list, list, bool]:
        """The requests of a `generate` call, the prefill requests their parallel samples
        share (n > 1), and whether it was one prompt (one dict back)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        tm = self.tokenizer_manager
        single = isinstance(prompt, str) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], int)
        )
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [tm.tokenize(p) for p in prompts]
        else:
            ids_list = [input_ids] if single else list(input_ids)
        params = [  # SGLang's spelling, as /generate takes it (sampling_seed, nulls dropped)
            clean_sampling_params(sp)
            for sp in (
                sampling_params
                if isinstance(sampling_params, list)
                else [sampling_params] * len(ids_list)
            )
        ]
        rids = [None] * len(ids_list) if rid is None else [rid] if isinstance(rid, str) else rid
        if len(rids) != len(ids_list):
            raise ValueError(f"{len(rids)} rids for {len(ids_list)} prompts")
        if len({r for r in rids if r is not None}) != len(rids) - rids.count(None):
            raise ValueError("request ids in one batch must be distinct")  # as /generate
        n = pop_n(params)
        if n > 1:  # n samples per prompt, prompt-major; they share the prompt's prefill
            ids_list = [ids for ids in ids_list for _ in range(n)]
            params = [s for sp in params for s in parallel_samples(sp, n)]
            rids = [None if r is None else f"{r}-{j}" for r in rids for j in range(n)]
            single = False
        reqs = [
            tm.make_request(
                ids,
                sp,
                r,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                stream,
                extra_key=key,
                token_ids_logprob=token_ids_logprob,
            )
            for ids, sp, r in zip(ids_list, params, rids)
        ]
        prefills = []
        if n > 1:
            prefills = [tm.prefill_request(reqs[i : i + n]) for i in range(0, len(reqs), n)]
        return reqs, prefills, single

    async def _gather(self, reqs):
        """The final outputs of `reqs`, in order; one failing (or this cancelled) aborts
        every other (a plain gather left them running to the end, unseen)."""

        async def one(r):
            last = None
            async for out in self.tokenizer_manager.generate_one(r):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _steps(self, reqs, prefills, single) -> AsyncIterator[dict]:
        """Every step's output of `reqs` (on the Engine's loop), "index" added unless one."""
        if prefills:
            await self._gather(prefills)
        streams = [self.tokenizer_manager.generate_one(r) for r in reqs]
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                out = sglang_logprob_entries(out)
                if not single:
                    out["index"] = i
                yield out

    def _stream(self, reqs, prefills, single) -> Iterator[dict]:
        steps = _LoopSteps(self._steps(reqs, prefills, single))
        try:
            while True:
                try:
                    yield self._run(steps.next())
                except StopAsyncIteration:
                    return
        finally:  # left early: the requests still running are aborted
            if self._loop_thread.is_alive():  # not shut down
                self._run(steps.close())

    async def _async_stream(self, reqs, prefills, single) -> AsyncIterator[dict]:
        steps = _LoopSteps(self._steps(reqs, prefills, single))
        try:
            while True:
                try:
                    yield await self._on_engine(steps.next())
                except StopAsyncIteration:
                    return
        finally:  # left early or cancelled: the requests still running are aborted
            if self._loop_thread.is_alive():  # not shut down
                await self._on_engine(steps.close())

    def get_internal_state(self) -> dict:
        return self._run(self.tokenizer_manager.internal_state())

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache())

    def shutdown(self) -> None:
        self.tokenizer_manager.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)
        if not self._loop_thread.is_alive():
            self.loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _LoopSteps:
    """An async generator of the Engine's loop, stepped from another thread or event loop
    (`next` and `close` run on the Engine's loop). A caller cancelled (or interrupted) while
    it waits for a step leaves that step running on the Engine's loop, cancelled at best, and
    a generator in the middle of a step cannot be closed (`aclose` raises RuntimeError):
    `close` cancels the step still in flight and waits for it to end, then closes."""

    def __init__(self, gen: AsyncIterator[dict]) -> None:
        self.gen = gen
        self.step: asyncio.Task | None = None  # the step in flight, or the last one

    async def next(self) -> dict:
        self.step = asyncio.ensure_future(self.gen.__anext__())
        return await self.step  # a cancelled caller cancels the step too

    async def close(self) -> None:
        step = self.step
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await self.gen.aclose()
