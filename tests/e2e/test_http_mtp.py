"""A server with MTP speculative decoding: greedy output is exactly the plain server's
(lossless), and the speculative fields reach meta_info, /server_info and /metrics."""

from __future__ import annotations

import json
import re

import pytest

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "for i in range(10):\n    print("]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def test_mtp_greedy_is_lossless_and_reports_acceptance(server, mtp_server):
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    plain = server.post("/generate", json=body).json()
    spec = mtp_server.post("/generate", json=body).json()
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    verify_ct = 0
    for o in spec:
        meta = o["meta_info"]
        assert meta["completion_tokens"] == 16
        # Prefill makes the first token; each verify step commits 1 to 1 + 2 more.
        assert 15 / 3 <= meta["spec_verify_ct"] <= 15
        assert meta["spec_accept_length"] == pytest.approx(16 / meta["spec_verify_ct"])
        verify_ct += meta["spec_verify_ct"]
    assert "spec_verify_ct" not in plain[0]["meta_info"]

    state = mtp_server.internal_state()
    assert state["avg_spec_accept_length"] == pytest.approx(3 * 16 / verify_ct)
    assert mtp_server.metric("sglang:spec_verify_steps_total") == verify_ct
    assert mtp_server.metric("sglang:spec_output_tokens_total") == 3 * 16
    assert mtp_server.metric("sglang:spec_accept_length") == pytest.approx(3 * 16 / verify_ct)
    drafts = mtp_server.metric("sglang:spec_num_drafts_total")
    assert drafts == state["spec_num_verify"] >= verify_ct
    assert mtp_server.metric("sglang:spec_draft_tokens_total") == 2 * drafts
    accepted = mtp_server.metric("sglang:spec_accepted_tokens_total")
    assert accepted == state["spec_accepted_tokens"] == sum(state["spec_accepted_per_position"])
    assert 0 < accepted <= 2 * drafts
    per_position = [
        float(line.rsplit(" ", 1)[1])
        for line in mtp_server.get("/metrics").text.splitlines()
        if line.startswith("sglang:spec_accepted_per_position_total{")
    ]
    assert per_position == [float(n) for n in state["spec_accepted_per_position"]]
    # fixed K: every step verifies 2 drafts per request (a step verifies the whole batch);
    # the second draft is examined when the first is accepted
    hist = state["spec_draft_length_steps"]
    assert list(hist) == ["2"] and 0 < hist["2"] <= drafts
    drafted = state["spec_drafted_per_position"]
    assert drafted == [drafts, state["spec_accepted_per_position"][0]]
    rates = state["spec_acceptance_per_position"]
    assert rates == pytest.approx([a / d for a, d in zip(per_position, drafted)])
    steps = [
        float(line.rsplit(" ", 1)[1])
        for line in mtp_server.get("/metrics").text.splitlines()
        if line.startswith('sglang:spec_draft_length_steps_total{k="2",')
    ]
    assert steps == [hist["2"]]
    info = mtp_server.get("/server_info").json()
    assert info["speculative_algorithm"] == "MTP" and info["speculative_num_steps"] == 2


def test_mtp_stream_carries_spec_fields(mtp_server):
    r = mtp_server.post(
        "/generate",
        json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True},
        stream=True,
    )
    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    # Several tokens can arrive per step, so there are fewer chunks than tokens.
    assert len(chunks) < 16
    assert chunks[-1]["meta_info"]["completion_tokens"] == 16
    assert all("spec_accept_length" in c["meta_info"] for c in chunks)


def test_mtp_under_grammars_is_lossless(server, mtp_server):
    """Greedy outputs under a regex and a JSON schema, and seeded samples under a regex, are
    the plain server's; every output follows its grammar."""
    regex = r"[a-z_]{1,8}\((n|[0-9]{1,2})\)"
    # a JSON value without whitespace inside (the tiny model fills an object's with newlines)
    schema = '{"type": "integer", "minimum": 0, "maximum": 999}'
    params = [
        {"max_new_tokens": 32, "temperature": 0, "regex": regex},
        {"max_new_tokens": 32, "temperature": 0, "json_schema": schema},
        {"max_new_tokens": 32, "temperature": 0.8, "seed": 7, "regex": "(a|b|c)d?"},
    ]
    body = {"text": [PROMPTS[0]] * 3, "sampling_params": params}
    plain = server.post("/generate", json=body).json()
    spec = mtp_server.post("/generate", json=body).json()
    assert [o["output_ids"] for o in spec[:2]] == [o["output_ids"] for o in plain[:2]]
    assert re.fullmatch(regex, spec[0]["text"]), spec[0]["text"]
    assert 0 <= json.loads(spec[1]["text"]) <= 999
    assert re.fullmatch("(a|b|c)d?", spec[2]["text"]), spec[2]["text"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in spec)


def test_sampled_logprobs_are_over_the_temperature_with_mtp_on_and_off(server, mtp_server):
    """SGLang's sampler reports a sampled request's logprobs as log_softmax(logits / T) (a
    greedy one's at T = 1), from the plain step and the MTP verify alike. T = 0.5 with a
    top_p that keeps only the top token samples the greedy tokens, so at every position the
    gaps between the top logprobs are twice the greedy request's."""
    hot = {**GREEDY, "temperature": 0.5, "top_p": 1e-9, "seed": 3}
    greedy = {"text": PROMPTS[0], "sampling_params": GREEDY}
    want = server.post("/generate", json={**greedy, "return_logprob": True, "top_logprobs_num": 3})
    want = want.json()
    for s in (server, mtp_server):
        body = {**greedy, "sampling_params": hot, "return_logprob": True, "top_logprobs_num": 3}
        got = s.post("/generate", json=body).json()
        assert got["output_ids"] == want["output_ids"]
        got_tops = got["meta_info"]["output_top_logprobs"]
        for g, w in zip(got_tops, want["meta_info"]["output_top_logprobs"]):
            assert [e[1] for e in g] == [e[1] for e in w]
            for a, b in zip(g[1:], w[1:]):
                assert a[0] - g[0][0] == pytest.approx(2 * (b[0] - w[0][0]), rel=1e-3, abs=1e-4)
        chosen = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
        assert chosen == pytest.approx([g[0][0] for g in got_tops])
    assert mtp_server.post("/generate", json=body).json()["meta_info"]["spec_verify_ct"] > 0


@pytest.mark.parametrize(
    "extreme",
    [
        {"temperature": 1.0, "top_p": 1e-46},  # a valid top_p that float32 rounds to 0
        {"temperature": 1.0, "logit_bias": {"5": 3.5e38}},  # past float32's largest
        {"temperature": 0.01, "logit_bias": {"5": 1e38}},  # overflows once divided by T
    ],
)
def test_sampling_settings_at_float32_limits_give_their_limit_answer(server, mtp_server, extreme):
    """Sampling settings whose float32 form is 0 or +inf: a top_p that keeps only the top
    token samples the greedy tokens, a bias that overflows forces its token, with finite
    logprobs, MTP on and off (softmax over NaNs sampled the vocabulary's last token)."""
    prompt = {"text": PROMPTS[0], "return_logprob": True}
    want = server.post("/generate", json={**prompt, "sampling_params": GREEDY}).json()
    sp = {**GREEDY, "max_new_tokens": 4, "seed": 5, **extreme}
    if "logit_bias" in extreme:
        want = {"output_ids": [5] * 4}
    for s in (server, mtp_server):
        got = s.post("/generate", json={**prompt, "sampling_params": sp}).json()
        assert got["output_ids"] == want["output_ids"][:4], (s.url, extreme)
        lps = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
        assert all(isinstance(v, float) and v <= 0 for v in lps), lps


def test_a_temperature_past_float32_range_samples_within_the_masks(server, mtp_server):
    """temperature 1e39 (+inf in float32) samples uniformly among the tokens a grammar (or
    min_new_tokens) leaves, MTP on and off, with finite logprobs: their -inf / inf was NaN
    (a token outside the grammar, the request aborted; null logprobs)."""
    sp = {"max_new_tokens": 4, "temperature": 1e39, "seed": 9}
    body = {"text": PROMPTS[0], "return_logprob": True}
    for s in (server, mtp_server):
        for masks in ({"regex": "[0-9]+"}, {"min_new_tokens": 4}):
            got = s.post("/generate", json={**body, "sampling_params": {**sp, **masks}}).json()
            assert got["meta_info"]["finish_reason"]["type"] in ("length", "stop"), got
            if "regex" in masks:
                assert re.fullmatch("[0-9]+", got["text"]), got["text"]
            else:
                assert len(got["output_ids"]) == 4
            lps = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
            assert all(isinstance(v, float) and v < 0 for v in lps), (masks, lps)


def test_a_repetition_penalty_near_zero_is_its_limit(server, mtp_server):
    """repetition_penalty 1e-46 (0 in float32) decodes as 1e-20 does, MTP on and off: the
    seen tokens' logits were all +inf, a tie the lowest token id won."""
    prompt = {"text": "def f(x): return x + x + x", "return_logprob": True}
    sp = {**GREEDY, "max_new_tokens": 4}
    want = server.post(
        "/generate", json={**prompt, "sampling_params": {**sp, "repetition_penalty": 1e-20}}
    )
    want = want.json()["output_ids"]
    for s in (server, mtp_server):
        got = s.post(
            "/generate", json={**prompt, "sampling_params": {**sp, "repetition_penalty": 1e-46}}
        )
        assert got.json()["output_ids"] == want, s.url


def test_per_request_draft_length_is_checked_and_reported(server, mtp_server):
    """`sampling_params.speculative_num_steps`: 400 naming it past the server's K (2 here),
    when negative, or when the server drafts nothing; on /generate and the OpenAI routes.
    Asked lengths stay lossless and reach meta_info and /metrics' per-request histograms.
    (Last in this module: the earlier test counts the server's fixed-K steps.)"""
    body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "speculative_num_steps": 3}}
    for s, steps in ((mtp_server, 3), (mtp_server, -1), (server, 1)):
        body["sampling_params"]["speculative_num_steps"] = steps
        r = s.post("/generate", json=body)
        assert r.status_code == 400 and "speculative_num_steps" in r.text, r.text[:300]
    completion = {"model": "tiny-mtp", "prompt": PROMPTS[0], "max_tokens": 4}
    r = mtp_server.post("/v1/completions", json={**completion, "speculative_num_steps": 3})
    assert r.status_code == 400 and "speculative_num_steps" in r.text, r.text[:300]
    r = mtp_server.post("/v1/completions", json={**completion, "speculative_num_steps": 1})
    assert r.status_code == 200, r.text[:300]
    body["sampling_params"]["speculative_num_steps"] = 0
    assert server.post("/generate", json=body).status_code == 200  # 0 is always allowed

    before = mtp_server.metric("sglang:spec_request_draft_length_count")
    plain = server.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY}).json()
    asked = [0, 1, None]
    params = [{**GREEDY, "speculative_num_steps": k} for k in asked]
    outs = mtp_server.post("/generate", json={"text": PROMPTS, "sampling_params": params}).json()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    for o, k in zip(outs, (0, 1, 2)):
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["spec_draft_tokens"] == k * meta["spec_verify_ct"] > 0 or k == 0
        assert meta["spec_draft_length"] == k
        assert 0 <= meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
    assert outs[0]["meta_info"]["spec_accepted_tokens"] == 0
    # every plain step counted, the one that finished the request too
    assert outs[0]["meta_info"]["spec_verify_ct"] == outs[0]["meta_info"]["completion_tokens"] - 1
    assert mtp_server.metric("sglang:spec_request_draft_length_count") == before + 3
    assert mtp_server.metric("sglang:spec_request_accept_length_count") == before + 3
