"""The lossless invariant with --enable-torch-compile (inductor on CPU, the settings the CPU
platform ships): greedy float32 outputs are token-identical to eager decoding without
speculation, for MTP (K = 1, FIA verify: the CPU default) while batches move between the
compiled bucket (1 request) and an uncompiled one (2), and while shapes switch from uncompiled
to compiled: the engine serves at once and compiles while idle, so the first prompts, sent
one at a time, run with some shapes compiled and others not. Compiling costs 40-60 s per
shape on 2 cores, so one engine with three compiled shapes (decode, verify, draft extend; one
KV window: short prompts and context) serves the module; the other layouts, K and kinds are
checked shape by shape through dynamo in tests/unit/test_torch_compile.py."""

from __future__ import annotations

import os
import time

import pytest
from lossless import GREEDY, PROMPTS, assert_same_greedy

from srt_ascend import Engine

SHORT = [i for i, p in enumerate(PROMPTS) if len(p) < 150][:12]
COMPILED = {
    "speculative_algorithm": "MTP",
    "speculative_num_steps": 1,
    "enable_torch_compile": True,
    "torch_compile_max_bs": 1,
    "cuda_graph_bs": (1, 2),
    "max_running_requests": 2,
    "context_length": 100,  # req_to_token rows of 117: one KV window
}


ONE_BY_ONE = 4  # prompts sent one at a time, each after one more shape compiled


def next_progress(engine: Engine, last: dict | None) -> dict:
    """The compile progress once it moved past `last` (None: now)."""
    deadline = time.monotonic() + 600
    while True:
        progress = engine.get_internal_state()["torch_compile"]
        if last is None or progress["compiled"] > last["compiled"] or progress["ready"]:
            return progress
        assert time.monotonic() < deadline, f"no shape compiled in 10 minutes: {progress}"
        time.sleep(1)


@pytest.fixture(scope="module")
def compiled_run(model_path, tmp_path_factory):
    """(outputs, final internal state, compile progress before each prompt sent alone and
    after the last prompt). The engine serves at once; its idle scheduler compiles one shape
    between two of the first prompts, so they run with 0, 1, 2 and 3 of the 3 compiled. An
    empty compile cache: a warm one would load every shape at start (compile_packages.py),
    and the shapes then run from the packages the compiles wrote."""
    prompts = [PROMPTS[i] for i in SHORT]
    old_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile_cache"))
    engine = Engine(model_path=model_path, dtype="float32", **COMPILED)
    try:
        outs, progress = [], [None]
        for prompt in prompts[:ONE_BY_ONE]:
            progress.append(next_progress(engine, progress[-1]))
            outs.append(engine.generate(prompt, GREEDY, return_logprob=True))
        outs += engine.generate(prompts[ONE_BY_ONE:], GREEDY, return_logprob=True)
        state = engine.get_internal_state()
        progress.append(state["torch_compile"])
        assert (
            state["available_kv_tokens"] + state["cached_tokens_in_tree"]
            == state["max_total_num_tokens"]
        ), "KV slots leaked"
        return outs, state, progress[1:]
    finally:
        engine.shutdown()
        if old_cache is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_cache


def test_compiled_greedy_identical_to_eager(compiled_run, baseline):
    outs, _, _ = compiled_run
    assert_same_greedy("compiled mtp-k1-fia", outs, [baseline[i] for i in SHORT])


def test_shapes_switch_to_compiled_between_prompts(compiled_run):
    _, _, progress = compiled_run
    assert [p["compiled"] for p in progress] == [0, 1, 2, 3, 3], progress
    assert progress[-1] == {"compiled": 3, "loaded": 0, "total": 3, "ready": True}, progress


def test_every_kind_replayed_compiled_and_uncompiled(compiled_run):
    _, state, _ = compiled_run
    compiled = {k for k, n in state["graph_compiled_replays"].items() if n}
    assert {"verify_fia", "draft_extend"} <= compiled, state
    uncompiled = {
        k
        for k, n in state["graph_replays"].items()
        if n > state["graph_compiled_replays"].get(k, 0)
    }
    assert "verify_fia" in uncompiled, state  # bucket 2 ran too
