"""Shared pieces of the end-to-end lossless tests: 50 varied held-out prompts, one engine run,
and the comparison against the eager, speculation-off baseline (tests/engine/conftest.py)."""

from __future__ import annotations

from srt_ascend import Engine
from srt_ascend.tools.corpus import list_files, split

MAX_NEW = 16
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def varied_prompts(n: int = 50) -> list[str]:
    """Held-out stdlib snippets of varied lengths; every fifth shares a long prefix with the
    one before it, so the radix cache is hit."""
    _, held = split(list_files())
    out: list[str] = []
    for i, f in enumerate(held):
        text = f.read()
        if len(text) < 400:
            continue
        start = (i * 997) % max(1, len(text) - 400)
        snippet = text[start : start + 40 + (i * 37) % 300]
        out.append(snippet)
        if len(out) % 5 == 4:
            out.append(snippet + "\n    # variant\n")
        if len(out) >= n:
            break
    return out[:n]


PROMPTS = varied_prompts()


def run(model_path, prompts=PROMPTS, return_logprob: bool = True, **kw):
    engine = Engine(model_path=model_path, dtype="float32", **kw)
    try:
        outs = engine.generate(prompts, GREEDY, return_logprob=return_logprob)
        state = engine.get_internal_state()
        assert (
            state["available_kv_tokens"] + state["cached_tokens_in_tree"]
            == state["max_total_num_tokens"]
        ), "KV slots leaked"
        return outs, state
    finally:
        engine.shutdown()


def assert_same_greedy(name, outs, baseline, tol: float = 1e-3):
    """Token-identical outputs, every one ended by its length (an aborted request has no
    output to differ), emitted tokens' logprobs within `tol`."""
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs), name
    mismatches = [i for i, o in enumerate(outs) if o["output_ids"] != baseline[i]["output_ids"]]
    assert not mismatches, f"{name}: {len(mismatches)} prompts differ, e.g. #{mismatches[0]}"
    for o, b in zip(outs, baseline):
        got = [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        assert len(got) == MAX_NEW
        assert max(abs(x - y) for x, y in zip(got, want)) < tol, name
