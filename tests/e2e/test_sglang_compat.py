"""Behaviour SGLang's own OpenAI-server tests expect, against the shared server: /v1/responses'
truncation and penalty fields and its error shape, stream_options.continuous_usage_stats,
SGLang's messages for an overlong chat max_tokens and an out-of-vocabulary /v1/score label."""

from __future__ import annotations

import json

import openai
import pytest

CHAT = [{"role": "user", "content": "def f("}]
TURN = "def f(x):\n    return x + 1\n" * 40  # about 440 tokens


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _context(server) -> int:
    return server.get("/model_info").json()["context_length"]


# ---- /v1/responses ----------------------------------------------------------------------------


def test_responses_take_truncation_and_the_penalties(server):
    """The openai client's truncation and the penalties are accepted; the penalties act as
    on chat (the same output at temperature 0, and not the unpenalised one)."""
    client = _client(server)
    prompt = "def f(x):\n    return x + x + x + x"
    call = dict(model="tiny-mtp", max_output_tokens=24, temperature=0, truncation="disabled")
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 1.0}  # SGLang's extensions
    penalised = client.responses.create(input=prompt, extra_body=penalties, **call)
    assert penalised.truncation == "disabled"
    chat = dict(model="tiny-mtp", messages=[{"role": "user", "content": prompt}], max_tokens=24)
    chat["temperature"] = 0
    same = client.chat.completions.create(**penalties, **chat)
    plain = client.chat.completions.create(**chat)
    assert penalised.output_text == same.choices[0].message.content
    assert plain.choices[0].message.content != same.choices[0].message.content


def test_responses_errors_have_the_responses_shape(server):
    r = server.post("/v1/responses", json={"model": "tiny-mtp", "input": "a", "bogus": 1})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "bogus is not supported by this server",
            "type": "invalid_request_error",
            "param": "bogus",
            "code": 400,
        }
    }
    r = server.get("/v1/responses/resp_missing")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "Response with id 'resp_missing' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    with pytest.raises(openai.BadRequestError) as bad:
        _client(server).responses.create(model="tiny-mtp", input="a", truncation="sometimes")
    assert (bad.value.type, bad.value.param) == ("invalid_request_error", "truncation")
    no_schema = {"format": {"type": "json_schema", "name": "x"}}
    r = server.post("/v1/responses", json={"model": "tiny-mtp", "input": "a", "text": no_schema})
    assert r.status_code == 400 and "needs its schema" in r.json()["error"]["message"]
    chat = server.post(
        "/v1/chat/completions", json={"model": "tiny-mtp", "messages": CHAT, "bogus": 1}
    )
    assert chat.json()["object"] == "error"  # the other /v1 routes keep SGLang's shape


def test_responses_truncation_auto_drops_the_earliest_turns(server):
    """A conversation longer than the context: refused with truncation "disabled", answered
    with "auto" exactly as its longest suffix (from a user turn) that fits."""
    ctx, out = _context(server), 4
    turns = []
    while sum(len(t["content"]) for t in turns) < 6 * ctx:  # well past the context
        turns += [{"role": "user", "content": TURN}, {"role": "assistant", "content": TURN}]
    turns.append({"role": "user", "content": "def g("})
    body = {"model": "tiny-mtp", "max_output_tokens": out, "temperature": 0}
    refused = server.post("/v1/responses", json={**body, "input": turns, "truncation": "disabled"})
    assert refused.status_code == 400 and "context length" in refused.json()["error"]["message"]
    auto = server.post("/v1/responses", json={**body, "input": turns, "truncation": "auto"})
    assert auto.status_code == 200, auto.text
    auto = auto.json()
    assert auto["truncation"] == "auto"
    assert auto["usage"]["input_tokens"] + out < ctx
    for cut in range(2, len(turns), 2):  # the longest suffix from a user turn that fits
        r = server.post("/v1/responses", json={**body, "input": turns[cut:]})
        if r.status_code == 200:
            break
    assert r.json()["usage"]["input_tokens"] == auto["usage"]["input_tokens"]
    assert r.json()["output"][0]["content"] == auto["output"][0]["content"]


# ---- continuous usage -------------------------------------------------------------------------


def _chunks(server, path: str, body: dict) -> list[dict]:
    r = server.post(path, json={**body, "stream": True}, stream=True)
    assert r.status_code == 200, r.text
    lines = [x for x in r.iter_lines() if x.startswith(b"data: ") and x != b"data: [DONE]"]
    return [json.loads(x[len(b"data: ") :]) for x in lines]


@pytest.mark.parametrize(
    "path, body, choices",
    [
        ("/v1/chat/completions", {"messages": CHAT}, 2),
        ("/v1/completions", {"prompt": ["def f(", "class A"]}, 4),
    ],
    ids=["chat", "completions"],
)
def test_continuous_usage_stats_on_every_chunk(server, path, body, choices):
    """Every choice chunk carries its choice's usage so far (SGLang 0.5.23); the per-choice
    totals add up to the final usage chunk. Control: without it only the last chunk has one."""
    body = {"model": "tiny-mtp", "max_tokens": 6, "n": 2, "temperature": 0, **body}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(server, path, {**body, "stream_options": options})
    *choice_chunks, final = chunks
    assert final["choices"] == [] and choice_chunks
    last: dict[int, dict] = {}
    for c in choice_chunks:
        used, index = c["usage"], c["choices"][0]["index"]
        assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"]
        assert used["completion_tokens"] >= last.get(index, {}).get("completion_tokens", 0)
        last[index] = used
    assert sorted(last) == list(range(choices))
    per_choice = sum(u["completion_tokens"] for u in last.values())
    assert per_choice == final["usage"]["completion_tokens"]
    plain = _chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] is not None for c in plain] == [False] * (len(plain) - 1) + [True]


# ---- SGLang's messages ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_past_the_context_in_sglang_words(server, field):
    ctx = _context(server)
    body = {"model": "tiny-mtp", "messages": CHAT, field: ctx + 1}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["message"] == (
        f"max_completion_tokens is too large: {ctx + 1}."
        f"This model supports at most {ctx} completion tokens."
    )


def test_score_out_of_vocabulary_label_in_sglang_words(server):
    vocab = server.post(
        "/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [10**9]}
    ).json()["message"]
    assert vocab.startswith("Token ID 1000000000 is out of vocabulary (vocab size: ")
    body = {"model": "tiny-mtp", "query": "a", "items": ["b"], "label_token_ids": [-1]}
    assert server.post("/v1/score", json=body).json()["message"] == (
        "label_token_ids must contain nonnegative integers"
    )
