"""The lossless invariant, end to end on the shipped checkpoint in float32: greedy outputs are
token-identical with MTP off or on (K = 1, 2, 3), with either verify path, radix cache on or
off, chunked prefill on or off, and concurrent batches of mixed lengths."""

from __future__ import annotations

import pytest
from lossless import PROMPTS, assert_same_greedy, run

from srt_ascend import Engine

SPEC = {"speculative_algorithm": "MTP"}
CONFIGS = {
    "mtp-k1-expand": {**SPEC, "speculative_verify": "expand"},
    "mtp-k2-expand": {**SPEC, "speculative_verify": "expand", "speculative_num_steps": 2},
    "mtp-k3-expand": {**SPEC, "speculative_verify": "expand", "speculative_num_steps": 3},
    "mtp-k1-fia": {**SPEC, "speculative_verify": "fia"},
    "mtp-k2-fia": {**SPEC, "speculative_verify": "fia", "speculative_num_steps": 2},
    "mtp-k3-fia": {**SPEC, "speculative_verify": "fia", "speculative_num_steps": 3},
    "mtp-k2-fia-no-radix": {**SPEC, "speculative_num_steps": 2, "disable_radix_cache": True},
    "mtp-k2-expand-chunked": {
        **SPEC,
        "speculative_verify": "expand",
        "speculative_num_steps": 2,
        "chunked_prefill_size": 32,
    },
    "mtp-k3-fia-page4-small-pool": {
        **SPEC,
        "speculative_num_steps": 3,
        "page_size": 4,
        "max_total_tokens": 1024,
        "chunked_prefill_size": 64,
    },
}


def test_prompts_are_varied():
    assert len(PROMPTS) == 50
    assert len({len(p) for p in PROMPTS}) > 20


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_with_mtp(model_path, baseline, name):
    outs, state = run(model_path, **CONFIGS[name])
    assert_same_greedy(name, outs, baseline)
    k = CONFIGS[name].get("speculative_num_steps", 1)
    # The shipped draft agrees with the target often: speculation really accepts tokens.
    assert 1.3 < state["avg_spec_accept_length"] <= k + 1
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert sum(state["spec_accepted_per_position"]) > 0


def test_sampling_with_mtp_is_seed_reproducible_and_mixes_settings(model_path):
    engine = Engine(
        model_path=model_path, dtype="float32", speculative_algorithm="MTP", speculative_num_steps=2
    )
    try:
        params = [
            {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 11},
            {"max_new_tokens": 12, "temperature": 0},
            {"max_new_tokens": 12, "temperature": 1.2, "top_k": 20, "min_p": 0.05, "seed": 5},
            {"max_new_tokens": 12, "temperature": 0.7, "repetition_penalty": 1.3, "seed": 3},
        ]
        first = engine.generate(PROMPTS[:4], params)
        again = engine.generate(PROMPTS[:4], params)
        for a, b in zip(first, again):
            assert a["output_ids"] == b["output_ids"]
            assert len(a["output_ids"]) == 12
        greedy = engine.generate(PROMPTS[1], {"max_new_tokens": 12, "temperature": 0})
        assert first[1]["output_ids"] == greedy["output_ids"]
    finally:
        engine.shutdown()
