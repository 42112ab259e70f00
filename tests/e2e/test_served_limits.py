"""Request limits and names against real servers (issue 46): one tokenize bound on every route
that tokenizes (the context length, or --max-tokenize-tokens), OpenAI's limits on a
response's `metadata` and `user`, SGLang's names in Responses usage, SGLang's 400 for a
`model` this server does not serve, and --max-payload-size as the request body bound."""

from __future__ import annotations

import json
import re

import pytest
import requests
from e2e_servers import running_server

SERVED = "tiny-mtp"  # the shared server's --served-model-name
PATH_NAME = "deepseek-v3-tiny-mtp"  # the last component of its model path
EMOJI = "\U0001f600" * 2000  # 2000 characters, 8001 tokens (four byte tokens each, and BOS)
USER = {"role": "user", "content": "hi"}


def _message(r: requests.Response) -> str:
    """The error message in any of the three error shapes (native, OpenAI, Responses)."""
    body = r.json()
    return body["message"] if "message" in body else body["error"]["message"]


def _tokenizing_calls(text: str, model: str = SERVED) -> list[tuple[str, dict]]:
    """One call per route that tokenizes `text` (a prompt, a chat template, a score query, a
    response input)."""
    chat = [{"role": "user", "content": text}]
    return [
        ("/v1/tokenize", {"model": model, "prompt": text}),
        ("/tokenize", {"model": model, "prompt": [text]}),
        ("/v1/tokenize", {"model": model, "messages": chat}),
        ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 1}),
        ("/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}),
        ("/v1/score", {"model": model, "query": text, "items": ["a"], "label_token_ids": [5]}),
        ("/v1/responses", {"model": model, "input": text, "max_output_tokens": 1}),
        ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}),
    ]


# ---- the tokenize bound -----------------------------------------------------------------------


def test_every_tokenizing_route_refuses_a_text_past_the_context(server):
    """2000 emoji are few characters but 8001 tokens (more in a chat template): every route
    that tokenizes answers 400 naming the bound (before, /v1/tokenize and /tokenize counted
    them with a 200)."""
    for path, body in _tokenizing_calls(EMOJI):
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, r.text[:200])
        expected = "tokens) is longer than the model's context length (4096 tokens)"
        assert expected in _message(r), (path, r.text[:200])
    assert server.get("/health").status_code == 200


# ---- /v1/responses: metadata, user, usage -----------------------------------------------------


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 properties"),
        ({"metadata": {"k" * 65: "v"}}, "keys may have at most 64"),
        ({"metadata": {"k": "v" * 513}}, "maximum length 512, but got a string with length 513"),
        ({"metadata": {"k": 1}}, "values must be strings"),
        ({"metadata": ["k"]}, "metadata must be an object"),
        ({"user": "u" * 65}, "Invalid 'user': string too long. Expected a string with maximum"),
    ],
    ids=["17-keys", "long-key", "long-value", "number-value", "list", "long-user"],
)
def test_responses_metadata_and_user_past_openai_limits_are_400(server, extra, words):
    body = {"model": SERVED, "input": "a", "max_output_tokens": 1, **extra}
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == next(iter(extra))


def test_responses_metadata_and_user_at_openai_limits_are_kept(server):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    body = {"model": SERVED, "input": "a", "max_output_tokens": 1, "metadata": metadata}
    r = server.post("/v1/responses", json={**body, "user": "u" * 64})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["metadata"] == metadata and out["user"] == "u" * 64
    assert server.get(f"/v1/responses/{out['id']}").json()["metadata"] == metadata


@pytest.mark.parametrize("stream", [False, True])
def test_responses_usage_carries_sglangs_names(server, stream):
    """Usage has OpenAI's input/output tokens and SGLang's prompt/completion tokens; a
    response cut by max_output_tokens is `incomplete` (OpenAI's; SGLang says completed)."""
    body = {"model": SERVED, "input": "def f(", "max_output_tokens": 3, "stream": stream}
    body["temperature"] = 0
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [line for line in r.text.splitlines() if line.startswith('data: {"type"')]
        out = json.loads(events[-1][6:])["response"]
    else:
        out = r.json()
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["input_tokens"] > 0
    assert usage["completion_tokens"] == usage["output_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if usage["output_tokens"] == 3:
        assert out["status"] == "incomplete"
        assert out["incomplete_details"] == {"reason": "max_output_tokens"}


# ---- model names ------------------------------------------------------------------------------


def _openai_calls(model: str) -> list[tuple[str, dict]]:
    """One small call per OpenAI route that takes a `model`."""
    return [
        ("/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": model, "messages": [USER], "max_tokens": 1}),
        ("/v1/responses", {"model": model, "input": "a", "max_output_tokens": 1}),
        ("/v1/score", {"model": model, "query": "a", "items": ["b"], "label_token_ids": [5]}),
        ("/v1/tokenize", {"model": model, "prompt": "a"}),
        ("/tokenize", {"model": model, "prompt": "a"}),
        ("/v1/detokenize", {"model": model, "tokens": [5]}),
        ("/detokenize", {"model": model, "tokens": [5]}),
    ]


def test_an_unknown_model_is_sglangs_400_on_every_openai_route(server):
    for path, body in _openai_calls("wrong_model_name"):
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert _message(r) == (
            "The model `wrong_model_name` does not exist. The served model name is `tiny-mtp`."
        ), path
    r = server.post("/v1/chat/completions", json=_openai_calls(f"{SERVED}:adapter")[1][1])
    assert r.status_code == 400 and "LoRA is not enabled" in _message(r)
    assert "does not exist" not in _message(r)  # SGLang's test of the name:adapter syntax


def test_the_served_name_the_model_path_and_its_name_are_served(server):
    path = server.get("/model_info").json()["model_path"]
    for name in (SERVED, path, PATH_NAME, "default"):
        for route, body in _openai_calls(name):
            r = server.post(route, json=body)
            assert r.status_code == 200, (name, route, r.text)
        assert server.get(f"/v1/models/{name}").status_code == 200, name
    assert server.get("/v1/models/wrong_model_name").status_code == 404


# ---- a server with explicit bounds, another served name and llguidance ----------------------

PAYLOAD = 65536


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory):
    args = ("--max-tokenize-tokens", "64", "--max-payload-size", str(PAYLOAD))
    args += ("--served-model-name", "served-46", "--grammar-backend", "llguidance")
    with running_server(tmp_path_factory.mktemp("bounded"), *args) as s:
        yield s


def test_max_tokenize_tokens_bounds_every_route(bounded_server, tokenizer):
    s = bounded_server
    text = "def f(x):\n    return x\n" * 8
    tokens = len(tokenizer.encode(text))
    assert 64 < tokens < 4096
    for path, body in _tokenizing_calls(text, "served-46"):
        r = s.post(path, json=body)
        assert r.status_code == 400, (path, r.text[:200])
        expected = "tokens) is longer than --max-tokenize-tokens (64 tokens)"
        assert expected in _message(r), (path, r.text[:200])
    r = s.post("/v1/tokenize", json={"messages": [USER] * 65})  # refused before templating
    assert r.status_code == 400 and "65 messages cannot fit --max-tokenize-tokens" in _message(r)
    r = s.post("/v1/tokenize", json={"prompt": "def f(x):\n"})
    assert r.status_code == 200 and r.json()["count"] < 64


def test_max_payload_size_is_the_body_bound(bounded_server):
    s = bounded_server
    r = s.post("/generate", data=b'{"text": "' + b"a" * PAYLOAD + b'"}', headers=_JSON)
    assert r.status_code == 413 and f"larger than {PAYLOAD} bytes" in _message(r)
    r = s.post("/generate", data=b'{"text": "' + b"a" * (PAYLOAD - 20) + b'"}', headers=_JSON)
    assert r.status_code == 400 and "--max-tokenize-tokens" in _message(r)  # read, then bounded
    assert s.get("/server_info").json()["max_payload_size"] == PAYLOAD


_JSON = {"Content-Type": "application/json"}


def test_a_served_model_name_and_the_path_name_are_served(bounded_server):
    s = bounded_server
    for name in ("served-46", PATH_NAME):
        r = s.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200, (name, r.text)
    r = s.post("/v1/completions", json={"model": SERVED, "prompt": "a", "max_tokens": 1})
    assert r.status_code == 400
    assert (
        _message(r) == "The model `tiny-mtp` does not exist. The served model name is `served-46`."
    )


def test_llguidance_serves_grammars_over_http(bounded_server):
    """--grammar-backend llguidance: a regex and a JSON schema constrain /generate's output;
    a structural tag (xgrammar's only) and a grammar that does not parse are 400."""
    s = bounded_server
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": "[a-z]{2,6}\\([0-9]\\)"}
    r = s.post("/generate", json={"text": "def f(", "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert re.fullmatch(sp["regex"], out["text"]), out["text"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    sp = {"max_new_tokens": 200, "temperature": 0, "json_schema": json.dumps(schema)}
    r = s.post("/generate", json={"text": "x = ", "sampling_params": sp})
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(r.json()["text"])["a"], int), r.text
    for bad, words in (
        ({"structural_tag": "{}"}, "structural_tag is not served by --grammar-backend llguidance"),
        ({"regex": "(a"}, "invalid regex"),
    ):
        r = s.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, **bad}})
        assert r.status_code == 400 and words in _message(r), r.text
