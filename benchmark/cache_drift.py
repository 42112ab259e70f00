"""Where a request's prefix comes from, and what that does to its numbers: the drift table of
`deterministic.py --drift`.

For each dtype and flag state, one engine computes the same held-out prompts (greedy, with
logprobs) whole on a cold radix cache, then again on the warm cache (every prompt but its last
token a hit), and a second engine computes them in 16-token chunks with the radix cache off.
A prompt "differs" when its tokens or any emitted token's logprob is not bit-identical to the
cold run's; the largest logprob difference over positions where the tokens still agree is
reported beside it. Without --enable-deterministic-inference float32 drifts by ~1e-6 (other
reduction orders over a cached or chunked prefix), which can flip a seeded sample; with the
flag every count is 0 (tests/engine/test_deterministic_cache.py asserts it).
"""

from __future__ import annotations

from spec_decode import prompts as held_out_prompts

from srt_ascend import Engine

CHUNK = 16


def _generate(engine: Engine, prompts: list[str], output_len: int) -> list[dict]:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(prompts, params, return_logprob=True)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "length", o["meta_info"]
    return outs


def _compare(outs: list[dict], base: list[dict]) -> tuple[int, float]:
    """(prompts not bit-identical to `base`, largest |logprob difference| where tokens agree)."""
    n, worst = 0, 0.0
    for o, b in zip(outs, base):
        lo = [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        n += (o["output_ids"], lo) != (b["output_ids"], lb)
        for t, u, x, y in zip(o["output_ids"], b["output_ids"], lo, lb):
            if t != u:
                break
            worst = max(worst, abs(x - y))
    return n, worst


def drift_row(model_path: str, dtype: str, flag: bool, prompts: list[str], output_len: int):
    """One row: cold vs warm and cold vs chunked for this dtype and flag state."""
    kw = {"model_path": model_path, "dtype": dtype, "enable_deterministic_inference": flag}
    engine = Engine(**kw)
    try:
        cold = _generate(engine, prompts, output_len)
        warm = _generate(engine, prompts, output_len)
    finally:
        engine.shutdown()
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in warm)
    engine = Engine(**kw, chunked_prefill_size=CHUNK, disable_radix_cache=True)
    try:
        chunked = _generate(engine, prompts, output_len)
    finally:
        engine.shutdown()
    (warm_n, warm_max), (chunk_n, chunk_max) = _compare(warm, cold), _compare(chunked, cold)
    return {
        "dtype": dtype,
        "flag": flag,
        "prompts": len(prompts),
        "warm_differ": warm_n,
        "warm_max_logprob_diff": warm_max,
        "chunked_differ": chunk_n,
        "chunked_max_logprob_diff": chunk_max,
    }


def drift_table(model_path: str, dtypes: list[str], n: int, output_len: int) -> list[dict]:
    """Every (dtype, flag) row, printed as a markdown table; returns the rows."""
    prompts = held_out_prompts(n)
    rows = [
        drift_row(model_path, dtype, flag, prompts, output_len)
        for dtype in dtypes
        for flag in (False, True)
    ]
    print("| dtype | flag | prompts | warm differ | warm max dlogprob | chunked differ | "
          "chunked max dlogprob |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['dtype']} | {'on' if r['flag'] else 'off'} | {r['prompts']} | "
            f"{r['warm_differ']} | {r['warm_max_logprob_diff']:.3g} | {r['chunked_differ']} | "
            f"{r['chunked_max_logprob_diff']:.3g} |"
        )
    return rows
