"""--enable-deterministic-inference (issue 46 item 4): a request's greedy tokens and logprobs do
not depend on where its prefix came from. The same 40 held-out prompts are computed whole on a
cold radix cache, then sent again to the same engine (their prefixes now come from the radix
cache), and computed in 16-token chunks with the radix cache off; all three are bit-identical,
float32 and bf16, MTP off and on (K = 2); seeded float32 sampling, cold vs warm, too.

Warm, every prompt but its last token comes from the cache (cold: none, but for three 1-token
hits within the batch). Control: without the flag, float32 logprobs differ cold vs warm
(measured: 34 of 40 prompts, by up to 1.9e-6 within 8 tokens) and cold vs chunked (40 of 40,
up to 3.9e-6), so the identity asserted here is not what float32 gives anyway.
"""

from __future__ import annotations

import pytest
from lossless import varied_prompts

from srt_ascend import Engine

PROMPTS = varied_prompts(40)  # held-out prompts; every fifth shares a prefix with the one before
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}


def generate(passes: int, params: dict = GREEDY, **kw) -> list[list[dict]]:
    """The prompts all at once, `passes` times in one engine, with logprobs; every output
    must have ended by its length."""
    engine = Engine(**kw)
    try:
        runs = [engine.generate(PROMPTS, params, return_logprob=True) for _ in range(passes)]
    finally:
        engine.shutdown()
    for outs in runs:
        assert len(outs) == len(PROMPTS)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert all(len(o["output_ids"]) == params["max_new_tokens"] for o in outs)
    return runs


def differing(outs: list[dict], base: list[dict]) -> list[int]:
    """Prompts whose tokens or emitted-token logprobs are not bit-identical to the base's."""

    def key(o):
        return o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]

    return [i for i, (o, b) in enumerate(zip(outs, base)) if key(o) != key(b)]


def cold_and_warm(params: dict = GREEDY, **kw) -> tuple[list[dict], list[dict]]:
    """The prompts on a cold radix cache, then again on the warm one (every prompt a hit)."""
    cold, warm = generate(2, params, **kw)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in warm)
    return cold, warm


@pytest.mark.parametrize("spec", [{}, SPEC], ids=["off", "mtp-k2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cold_warm_chunked_bit_identical_with_flag(model_path, dtype, spec):
    kw = {"model_path": model_path, "dtype": dtype, "enable_deterministic_inference": True}
    cold, warm = cold_and_warm(**kw, **spec)
    (chunked,) = generate(1, **kw, **spec, chunked_prefill_size=16, disable_radix_cache=True)
    assert differing(warm, cold) == []
    assert differing(chunked, cold) == []


def test_seeded_sampling_float32_cold_and_warm_bit_identical_with_flag(model_path):
    """The issue's symptom: a seeded float32 request gave other text on a warm cache
    (without the flag 35 of these 40 still do)."""
    params = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    kw = {"model_path": model_path, "dtype": "float32", "enable_deterministic_inference": True}
    cold, warm = cold_and_warm(params, **kw)
    assert differing(warm, cold) == []
    assert len({tuple(o["output_ids"]) for o in cold}) > 30  # really sampled, not constant


def test_without_flag_float32_cold_warm_chunked_differ(model_path):
    """The control: plain float32 logprobs change when the prefix comes from the cache or
    is chunked."""
    kw = {"model_path": model_path, "dtype": "float32"}
    cold, warm = cold_and_warm(**kw)
    (chunked,) = generate(1, **kw, chunked_prefill_size=16, disable_radix_cache=True)
    assert differing(warm, cold), "float32 without the flag matched: the test has no power"
    assert differing(chunked, cold), "float32 without the flag matched: the test has no power"
