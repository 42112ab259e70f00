"""The batched engine's greedy outputs equal a one-request-at-a-time dense reference decode,
whatever the batching, chunking, caching and memory pressure (float32)."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from srt_ascend import Engine

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}

CONFIGS = {
    "default": {},
    "chunked-16": {"chunked_prefill_size": 16},
    "no-chunking": {"chunked_prefill_size": -1},
    "no-radix": {"disable_radix_cache": True},
    "page-4": {"page_size": 4, "chunked_prefill_size": 16},
    "lpm": {"schedule_policy": "lpm"},
    "tiny-pool-retract": {"max_total_tokens": 160, "chunked_prefill_size": 32},
}


def _engine(model_path, **kw):
    return Engine(model_path=model_path, dtype="float32", num_threads=2, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_matches_reference(model_path, reference_decode, name):
    engine = _engine(model_path, **CONFIGS[name])
    try:
        tok = engine.tokenizer_manager.tokenizer
        # Twice the prompts, so the second half hits the radix cache.
        prompts = PROMPTS + [p + " x" for p in PROMPTS]
        outs = engine.generate(prompts, GREEDY)
        for p, out in zip(prompts, outs):
            expected = reference_decode(tok.encode(p), MAX_NEW)
            assert out["output_ids"] == expected, (name, p)
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        state = engine.get_internal_state()
        if name == "tiny-pool-retract":
            assert state["num_retractions"] > 0
        # Idle invariant: every slot is free or owned by the tree.
        assert (
            state["available_kv_tokens"] + state["cached_tokens_in_tree"]
            == state["max_total_num_tokens"]
        )
    finally:
        engine.shutdown()


def test_shared_prefix_hits_cache(model_path, reference_decode):
    engine = _engine(model_path)
    try:
        tok = engine.tokenizer_manager.tokenizer
        system = "import collections\nimport functools\nimport itertools\n\n\n" * 3
        first = engine.generate(system + "def a():", GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        outs = engine.generate([system + s for s in ("def b():", "class C:", "x = 1")], GREEDY)
        n_system = len(tok.encode(system))
        for s, out in zip(("def b():", "class C:", "x = 1"), outs):
            assert out["meta_info"]["cached_tokens"] >= n_system - 2
            assert out["output_ids"] == reference_decode(tok.encode(system + s), MAX_NEW)
        assert engine.get_internal_state()["cache_hit_rate"] > 0.5
    finally:
        engine.shutdown()


def test_closing_a_stream_aborts_and_frees(model_path):
    import asyncio

    engine = _engine(model_path)
    try:
        tm = engine.tokenizer_manager

        async def read_two_chunks():
            req = tm.make_request(tm.tokenize(PROMPTS[0]), {"max_new_tokens": 500}, stream=True)
            chunks = []
            agen = tm.generate_one(req)
            async for chunk in agen:
                chunks.append(chunk)
                if len(chunks) == 2:
                    break
            await agen.aclose()  # the client went away
            return chunks

        chunks = asyncio.run_coroutine_threadsafe(read_two_chunks(), engine.loop).result()
        assert len(chunks[1]["output_ids"]) == 2
        assert chunks[1]["meta_info"]["finish_reason"] is None
        for _ in range(100):  # the abort is processed by the scheduler thread
            state = engine.get_internal_state()
            if state["num_running_reqs"] == 0:
                break
        assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0
        assert (
            state["available_kv_tokens"] + state["cached_tokens_in_tree"]
            == state["max_total_num_tokens"]
        )
    finally:
        engine.shutdown()
