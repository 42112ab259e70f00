"""The lossless invariant with --enable-torch-compile (inductor on CPU, the settings the CPU
platform ships): greedy float32 outputs are token-identical to eager decoding without
speculation, for MTP (K = 1, FIA verify: the CPU default) while batches move between the
compiled bucket (1 request) and an uncompiled one (2). Compiling costs 40-60 s per shape on 2
cores, so one engine with three compiled shapes (decode, verify, draft extend; one KV window:
short prompts and context) serves the module; the other layouts, K and kinds are checked
shape by shape through dynamo in tests/unit/test_torch_compile.py."""

from __future__ import annotations

import pytest
from lossless import PROMPTS, assert_same_greedy, run

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


@pytest.fixture(scope="module")
def compiled_run(model_path):
    return run(model_path, [PROMPTS[i] for i in SHORT], **COMPILED)


def test_compiled_greedy_identical_to_eager(compiled_run, baseline):
    outs, _ = compiled_run
    assert_same_greedy("compiled mtp-k1-fia", outs, [baseline[i] for i in SHORT])


def test_every_kind_replayed_compiled_and_uncompiled(compiled_run):
    _, state = compiled_run
    compiled = {k for k, n in state["graph_compiled_replays"].items() if n}
    assert {"verify_fia", "draft_extend"} <= compiled, state
    uncompiled = {
        k
        for k, n in state["graph_replays"].items()
        if n > state["graph_compiled_replays"].get(k, 0)
    }
    assert "verify_fia" in uncompiled, state  # bucket 2 ran too
