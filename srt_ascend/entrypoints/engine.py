"""Engine: the in-process API, like sglang.Engine.

engine = Engine(model_path=...)            # defaults to the shipped checkpoint
out = engine.generate("def f(", {"max_new_tokens": 16, "temperature": 0})
outs = engine.generate(["a", "b"], {"max_new_tokens": 8})
engine.shutdown()
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from srt_ascend.entrypoints.generate_input import clean_sampling_params, parallel_samples, pop_n
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

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
    ) -> dict | list[dict]:
        """One prompt -> one dict; a list -> a list of dicts, in order, run concurrently.
        `sampling_params` "n" > 1 (the same for every prompt) -> n samples of each prompt, a
        list in prompt-major order, as /generate answers (a seed becomes one per sample)."""
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
        n = pop_n(params)
        if n > 1:  # n samples per prompt, prompt-major; they share the prompt's prefill
            ids_list = [ids for ids in ids_list for _ in range(n)]
            params = [s for sp in params for s in parallel_samples(sp, n)]
            single = False
        reqs = [
            tm.make_request(
                ids,
                sp,
                None,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
            )
            for ids, sp in zip(ids_list, params)
        ]
        if n > 1:
            prefills = [tm.prefill_request(reqs[i : i + n]) for i in range(0, len(reqs), n)]
            self._run(self._gather(prefills))
        outs = self._run(self._gather(reqs))
        return outs[0] if single else outs

    async def _gather(self, reqs):
        async def one(r):
            last = None
            async for out in self.tokenizer_manager.generate_one(r):
                last = out
            return last

        return await asyncio.gather(*(one(r) for r in reqs))

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
