"""SGLang's logit_bias and stop_regex sampling parameters, with MTP off and on: greedy outputs
are token-identical (the bias shapes draft and target logits alike), a -100 bias forbids a
token and +100 forces one, and stop_regex ends the output at its first match (trimmed; the
finish reason's `matched` is the pattern)."""

from __future__ import annotations

import os
import re

import pytest

from srt_ascend import Engine

PROMPT = "def fibonacci(n):\n"
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
STOP_REGEX = r"_[a-z]+_"


def run(model_path, requests: list[dict], **kw) -> list[dict]:
    engine = Engine(model_path=model_path, dtype="float32", **kw)
    try:
        return engine.generate([PROMPT] * len(requests), requests)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(model_path) -> dict:
    return run(model_path, [GREEDY])[0]


@pytest.fixture(scope="module")
def requests(plain) -> list[dict]:
    first, forced = plain["output_ids"][0], plain["output_ids"][3]
    return [
        {**GREEDY, "logit_bias": {str(first): -100}},
        {**GREEDY, "logit_bias": {str(forced): 100}},
        {**GREEDY, "max_new_tokens": 24, "stop_regex": ["^never$", STOP_REGEX]},
    ]


@pytest.fixture(scope="module")
def unspeculated(model_path, requests) -> list[dict]:
    return run(model_path, requests)


def test_logit_bias_and_stop_regex(plain, unspeculated):
    forbidden, forced = plain["output_ids"][0], plain["output_ids"][3]
    assert forbidden not in unspeculated[0]["output_ids"]
    assert unspeculated[1]["output_ids"] == [forced] * 16
    reason = unspeculated[2]["meta_info"]["finish_reason"]
    assert reason == {"type": "stop", "matched": STOP_REGEX}  # the pattern, as SGLang reports
    match = re.search(STOP_REGEX, plain["text"])
    assert match, "the regex must match the unconstrained output"
    assert unspeculated[2]["text"] == plain["text"][: match.start()]


@pytest.mark.parametrize(("k", "verify"), [(2, "fia"), (3, "expand")])
def test_identical_with_mtp(model_path, requests, unspeculated, k, verify):
    outs = run(
        model_path,
        requests,
        speculative_algorithm="MTP",
        speculative_num_steps=k,
        speculative_verify=verify,
    )
    for got, want in zip(outs, unspeculated):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_engine_parallel_samples_share_the_prompt(model_path):
    """n samples per prompt, prompt-major, as /generate answers; each sample finds its prompt
    in the radix cache (prefilled once). Seeded samples differ from each other, sample j is
    the single request seeded seed + j, and the same (seed, n) gives the same samples."""
    engine = Engine(model_path=model_path, dtype="float32")
    try:
        prompts = [PROMPT, "class Stack:\n"]
        sample = {"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3}
        outs = engine.generate(prompts, sample)
        again = engine.generate(prompts, sample)
        alone = [engine.generate(prompts[1], {**sample, "n": 1, "seed": 3 + j}) for j in (0, 2)]
        threads = engine.get_internal_state()["intra_op_threads"]
    finally:
        engine.shutdown()
    # no --num-threads: a rank leaves a core to the process's other threads (CpuPlatform)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads == max(1, cores - 1)
    assert len(outs) == 6
    for o in outs:
        assert o["meta_info"]["cached_tokens"] > 0
    ids = [o["output_ids"] for o in outs]
    assert [o["output_ids"] for o in again] == ids
    assert len({tuple(x) for x in ids[3:]}) == 3, ids[3:]
    assert [ids[3], ids[5]] == [a["output_ids"] for a in alone]
    assert ids[0] != ids[3]
