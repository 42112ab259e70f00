"""Grammar-constrained generation with MTP is lossless on the shipped checkpoint in float32:
greedy outputs under a regex and a JSON schema are token-identical with MTP off and on
(K = 1, 2, 3, both verify layouts) and follow their grammar; sampled outputs under a small
grammar follow the constrained distribution with MTP on as with it off (chi-square). The same
holds under --grammar-backend llguidance (K = 2)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from srt_ascend import Engine

REGEX = r"[a-z_]{1,8}\((n|[0-9]{1,2})\)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GREEDY = {"max_new_tokens": 64, "temperature": 0}
PROMPTS = ["def fibonacci(n):\n    return ", "x = ", "# Copyright", "person = "]
# every prompt under each grammar, and one unconstrained neighbour in the same batch
REQUESTS = (
    [(p, {**GREEDY, "regex": REGEX}) for p in PROMPTS]
    + [(p, {**GREEDY, "json_schema": json.dumps(SCHEMA)}) for p in PROMPTS]
    + [(PROMPTS[0], {**GREEDY, "max_new_tokens": 16})]
)
COMMON = {"dtype": "float32", "constrained_json_disable_any_whitespace": True}
SPEC = {"speculative_algorithm": "MTP"}
CONFIGS = {
    f"mtp-k{k}-{verify}": {**SPEC, "speculative_num_steps": k, "speculative_verify": verify}
    for k in (1, 2, 3)
    for verify in ("expand", "fia")
}


def run_greedy(model_path, **kw) -> tuple[list[dict], dict]:
    engine = Engine(model_path=model_path, **COMMON, **kw)
    try:
        outs = engine.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS])
        return outs, engine.get_internal_state()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def grammar_baseline(model_path) -> list[dict]:
    outs, _ = run_greedy(model_path)
    return outs


def test_greedy_outputs_follow_their_grammar(grammar_baseline):
    n = len(PROMPTS)
    for out in grammar_baseline[:n]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(REGEX, out["text"]), out["text"]
    for out in grammar_baseline[n : 2 * n]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        assert set(value) == {"name", "age", "tags"} and 0 <= value["age"] <= 99
        assert len(value["name"]) <= 6 and set(value["tags"]) <= {"a", "b"}
    # the neighbour is unconstrained: plain code, not a grammar's output
    assert not re.fullmatch(REGEX, grammar_baseline[-1]["text"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_under_grammar_identical_with_mtp(model_path, grammar_baseline, name):
    outs, state = run_greedy(model_path, **CONFIGS[name])
    for i, (got, want) in enumerate(zip(outs, grammar_baseline)):
        assert got["output_ids"] == want["output_ids"], f"{name}: request {i} differs"
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert state["spec_accepted_tokens"] > 0


# ---- sampling: the constrained distribution ---------------------------------------------------

SMALL_REGEX = "(a|b|c)d?"
SAMPLES = 240
# scipy.stats.chi2.ppf(0.999, dof) for dof = 1..8.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}


def sampled_texts(model_path, temperature: float, **kw) -> Counter:
    engine = Engine(model_path=model_path, **COMMON, **kw)
    try:
        params = [
            {"max_new_tokens": 8, "temperature": temperature, "seed": s, "regex": SMALL_REGEX}
            for s in range(SAMPLES)
        ]
        outs = engine.generate(["x = "] * SAMPLES, params)
    finally:
        engine.shutdown()
    assert all(re.fullmatch(SMALL_REGEX, o["text"]) for o in outs)
    return Counter(o["text"] for o in outs)


def homogeneity_chi2(a: Counter, b: Counter) -> tuple[float, float]:
    """Two-sample chi-square statistic over the texts either sample saw, and its 0.999 bound."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for observed, n in ((a[k], na), (b[k], nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, CHI2_999[len(keys) - 1]


def test_sampling_under_grammar_follows_the_constrained_distribution(model_path):
    off = sampled_texts(model_path, 1.0)
    on = sampled_texts(model_path, 1.0, **SPEC, speculative_num_steps=2)
    assert len(off) >= 3, off  # the grammar leaves the model real choices
    stat, bound = homogeneity_chi2(off, on)
    assert stat < bound, f"MTP on {dict(on)} vs off {dict(off)}: chi2 {stat:.1f} >= {bound}"
    # the check has power: a different temperature is a different distribution
    cooler = sampled_texts(model_path, 0.5)
    stat, bound = homogeneity_chi2(off, cooler)
    assert stat > bound, f"temperature 0.5 {dict(cooler)} vs 1.0 {dict(off)}: chi2 {stat:.1f}"


# ---- --grammar-backend llguidance -------------------------------------------------------------

LLGUIDANCE = {"grammar_backend": "llguidance"}


@pytest.fixture(scope="module")
def llguidance_baseline(model_path) -> list[dict]:
    outs, _ = run_greedy(model_path, **LLGUIDANCE)
    return outs


def test_llguidance_greedy_outputs_follow_their_grammar(llguidance_baseline):
    """The same checks as under xgrammar. (The two libraries' masks differ at places: on the
    first JSON prompt xgrammar's greedy output spells the key "name" letter by letter where
    llguidance's takes the whole-word token, so the texts may differ.)"""
    test_greedy_outputs_follow_their_grammar(llguidance_baseline)


def test_llguidance_greedy_under_grammar_identical_with_mtp(model_path, llguidance_baseline):
    """MTP K = 2 under llguidance: its drafts are looked ahead over and rolled back in
    llguidance's matcher; every output is the MTP-off one, token for token."""
    outs, state = run_greedy(model_path, **LLGUIDANCE, **SPEC, speculative_num_steps=2)
    for i, (got, want) in enumerate(zip(outs, llguidance_baseline)):
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], i
        assert got["output_ids"] == want["output_ids"], f"request {i} differs"
    assert state["spec_accepted_tokens"] > 0


def test_llguidance_sampling_follows_the_constrained_distribution_with_mtp(model_path):
    off = sampled_texts(model_path, 1.0, **LLGUIDANCE)
    on = sampled_texts(model_path, 1.0, **LLGUIDANCE, **SPEC, speculative_num_steps=2)
    assert len(off) >= 3, off
    stat, bound = homogeneity_chi2(off, on)
    assert stat < bound, f"MTP on {dict(on)} vs off {dict(off)}: chi2 {stat:.1f} >= {bound}"
