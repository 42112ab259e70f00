from __future__ import annotations

import pytest

from srt_ascend.sampling.sampling_params import TOP_K_ALL, SamplingParams

VOCAB = 1000


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.n) == (128, 0, 1)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop is None and p.stop_token_ids is None and p.seed is None
    assert not p.ignore_eos and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.no_stop_trim
    p.verify(VOCAB)


def test_from_dict_sets_fields_and_none_means_default() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": None, "stop": "x", "seed": 7})
    assert p.temperature == 0.5 and p.top_k == -1 and p.stop == "x" and p.seed == 7
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_from_dict_rejects_unknown_fields_by_name() -> None:
    with pytest.raises(ValueError, match="max_tokens, typo_field"):
        SamplingParams.from_dict({"typo_field": 1, "max_tokens": 3, "temperature": 1.0})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be a non-negative"),
        ("temperature", float("nan"), "temperature must be a non-negative"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("top_k", 0, "top_k must be -1"),
        ("top_k", -2, "top_k must be -1"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
        ("frequency_penalty", 2.5, "frequency_penalty must be in"),
        ("presence_penalty", -2.5, "presence_penalty must be in"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in"),
        ("repetition_penalty", 2.1, "repetition_penalty must be in"),
        ("max_new_tokens", -1, "max_new_tokens must be at least 0"),
        ("min_new_tokens", -1, "min_new_tokens must be in"),
        ("min_new_tokens", 200, "min_new_tokens must be in"),
        ("n", 2, "n must be 1"),
        ("seed", -1, "seed must be in"),
        ("stop", "", "stop strings must be non-empty"),
        ("max_new_tokens", 1.5, "max_new_tokens must be an integer"),
        ("temperature", "hot", "temperature must be a number"),
        ("ignore_eos", 1, "ignore_eos must be a boolean"),
        ("stop", ["a", 3], "stop must be a string or a list"),
        ("seed", "1", "seed must be an integer"),
        ("speculative_num_steps", True, "speculative_num_steps must be an integer"),
        ("speculative_num_steps", -1, "speculative_num_steps must be at least 0"),
        ("stop_regex", "(a", "stop_regex '\\(a' is not a valid regex"),
        ("stop_regex", [3], "stop_regex must be a string or a list"),
        ("logit_bias", [1, 2], "logit_bias must be an object"),
        ("logit_bias", {"x": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {str(VOCAB): 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {"3": float("inf")}, "logit_bias values must be finite"),
        # int() would take these; a token id key is ASCII digits only
        ("logit_bias", {"1_0": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {" 10 ": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {"+10": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {"\u0661\u0660": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {True: 1.0}, "logit_bias keys must be token ids"),
        # RE2 (linear time) refuses what needs backtracking
        ("stop_regex", r"(a)\1", "not a valid regex for RE2"),
        ("stop_regex", ["ok", "(?=a)b"], "not a valid regex for RE2"),
        ("stop_regex", "a" * 4097, "at most 4096 are taken"),
    ],
)
def test_verify_rejects_bad_values(field: str, value: object, message: str) -> None:
    p = SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError, match=message):
        p.verify(VOCAB)


def test_verify_accepts_boundaries() -> None:
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=2.0,
        max_new_tokens=0,
        min_new_tokens=0,
        stop_token_ids=[0, VOCAB - 1],
        seed=2**64 - 1,
    ).verify(VOCAB)


def test_normalize_greedy_top_k_and_stop() -> None:
    p = SamplingParams(temperature=0.0, stop="END", stop_token_ids=[3, 3, 1]).normalize()
    assert (p.temperature, p.top_k) == (1.0, 1)
    assert p.stop == ["END"] and p.stop_token_ids == [3, 1]
    assert p.is_greedy
    q = SamplingParams(temperature=0.7).normalize()
    assert (q.temperature, q.top_k, q.stop, q.stop_token_ids) == (0.7, TOP_K_ALL, [], [])
    assert not q.is_greedy


def test_normalize_stop_regex_and_logit_bias() -> None:
    p = SamplingParams(stop_regex=r"\d+", logit_bias={"5": 2, "7": -1.5}).normalize()
    assert p.stop_regex == [r"\d+"] and p.logit_bias == {5: 2.0, 7: -1.5}
    p.verify(VOCAB)
    q = SamplingParams().normalize()
    assert (q.stop_regex, q.logit_bias) == ([], {})


def test_normalize_is_idempotent_and_verifiable() -> None:
    p = SamplingParams(temperature=1e-9, stop=["a", "b"])
    once = SamplingParams(**vars(p.normalize()))
    assert p.normalize() == once
    p.verify(VOCAB)


def test_normalize_leaves_negative_temperature_for_verify() -> None:
    p = SamplingParams(temperature=-1.0).normalize()
    with pytest.raises(ValueError, match="temperature"):
        p.verify(VOCAB)
