"""Bad input gets HTTP 400 with a message (SGLang's {"error": {"message"}} on the native API,
SGLang's {"object": "error", "message", "type", "param", "code"} on /v1), and the server keeps
serving. Bodies must be JSON (415), bounded (413); state changes are POST-only (405)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

OK_SP = {"max_new_tokens": 2, "temperature": 0}

JSON = {"Content-Type": "application/json"}


def _body(body) -> dict:
    return {"data": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}


NATIVE_CASES = {
    "malformed-json": (b'{"text": "a", ', "not valid JSON"),
    "not-an-object": ([1, 2], "must be a JSON object"),
    "text-wrong-type": ({"text": 5}, "text must be a string"),
    "text-empty-batch": ({"text": []}, "text must be a string"),
    "text-and-ids": ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    "no-prompt": ({"sampling_params": OK_SP}, "exactly one of text or input_ids"),
    "ids-wrong-type": ({"input_ids": ["a"]}, "input_ids must be a list of integers"),
    "ids-out-of-vocab": ({"input_ids": [10**9]}, "input_ids must be integers in"),
    "empty-ids": ({"input_ids": []}, "the input is empty"),
    "sp-wrong-type": ({"text": "a", "sampling_params": "fast"}, "sampling_params must be"),
    "negative-max-new": (
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "max_new_tokens must be at least 0",
    ),
    "max-new-wrong-type": (
        {"text": "a", "sampling_params": {"max_new_tokens": "10"}},
        "max_new_tokens must be an integer",
    ),
    "negative-temperature": (
        {"text": "a", "sampling_params": {"temperature": -0.5}},
        "temperature must be",
    ),
    "unknown-sampling-param": (
        {"text": "a", "sampling_params": {"max_tokens": 3}},
        "Unknown sampling parameter(s): max_tokens",
    ),
    "unsupported-custom-params": (
        {"text": "a", "sampling_params": {"custom_params": {"k": 1}}},
        "sampling_params.custom_params is not supported",
    ),
    "parallel-samples-differ": (
        {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]},
        "sampling_params.n must be the same for every prompt",
    ),
    "parallel-samples-zero": (
        {"text": "a", "sampling_params": {"n": 0}},
        "sampling_params.n must be an integer >= 1",
    ),
    "malformed-stop-regex": (
        {"text": "a", "sampling_params": {"stop_regex": ["ok", "(x"]}},
        "stop_regex '(x' is not a valid regex",
    ),
    "too-many-stop-regexes": (  # SGLang's cap: each is searched at every step
        {"text": "a", "sampling_params": {"stop_regex": [f"x{i}" for i in range(33)]}},
        "at most 32 stop_regex patterns are allowed, got 33",
    ),
    "logit-bias-out-of-vocab": (
        {"text": "a", "sampling_params": {"logit_bias": {"99999999": 5}}},
        "logit_bias keys must be token ids in",
    ),
    "logit-bias-not-a-number": (
        {"text": "a", "sampling_params": {"logit_bias": {"5": "high"}}},
        "logit_bias values must be finite numbers",
    ),
    "malformed-regex": (
        {"text": "a", "sampling_params": {"regex": "(a|b"}},
        "invalid regex: Regex parsing error at position 5: The parenthesis is not closed.",
    ),
    "malformed-json-schema": (
        {"text": "a", "sampling_params": {"json_schema": "{not json"}},
        "invalid json_schema: Failed to parse JSON",
    ),
    "unsupported-json-schema": (
        {"text": "a", "sampling_params": {"json_schema": '{"type": "foo"}'}},
        'invalid json_schema: Unsupported type "foo"',
    ),
    "malformed-ebnf": (
        {"text": "a", "sampling_params": {"ebnf": "root ::= "}},
        "invalid ebnf: EBNF parser error",
    ),
    "malformed-grammar-streamed": (
        {"text": ["a", "b"], "sampling_params": {"regex": "[a-"}, "stream": True},
        "invalid regex",
    ),
    "grammar-over-max-size": (
        {"text": "a", "sampling_params": {"json_schema": '{"type": "string"}' + " " * 131072}},
        "json_schema is 131090 characters; the limit is --grammar-max-size 131072",
    ),
    "two-grammars": (
        {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        "Only one of json_schema, regex, ebnf, structural_tag can be set",
    ),
    "grammar-not-a-string": (
        {"text": "a", "sampling_params": {"json_schema": {"type": "object"}}},
        "json_schema must be a string",
    ),
    "stream-wrong-type": ({"text": "a", "stream": "yes"}, "stream must be a boolean"),
    "batch-length-mismatch": (
        {"text": ["a", "b"], "sampling_params": [OK_SP]},
        "sampling_params has 1 entries for 2 prompts",
    ),
    "duplicate-rids": ({"text": ["a", "b"], "rid": ["same", "same"]}, "distinct"),
    "logprob-start-too-far": (
        {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 5},
        "logprob_start_len",
    ),
    "image-data": ({"text": "a", "image_data": "http://x/y.png"}, "image_data is not supported"),
    "top-logprobs-over-cap": ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num must be"),
    "token-ids-logprob-out-of-vocab": (
        {"text": "a", "return_logprob": True, "token_ids_logprob": [3, 99999999]},
        "token_ids_logprob: input_ids must be integers in",
    ),
    "token-ids-logprob-batch-mismatch": (
        {"text": ["a", "b"], "token_ids_logprob": [[3], [4], [5]]},
        "token_ids_logprob has 3 entries for 2 prompts",
    ),
    "token-ids-logprob-not-ids": (
        {"text": "a", "token_ids_logprob": "3"},
        "token_ids_logprob must be a list of token ids",
    ),
}


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_bad_input_is_400(server, case):
    body, message = NATIVE_CASES[case]
    r = server.post("/generate", **_body(body))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_prompt_longer_than_context(server):
    ctx = server.get("/model_info").json()["context_length"]
    r = server.post("/generate", json={"input_ids": [5] * (ctx + 1), "sampling_params": OK_SP})
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]
    r = server.post("/v1/completions", json={"model": "tiny-mtp", "prompt": [5] * (ctx + 1)})
    assert r.status_code == 400
    assert "context length" in r.json()["message"]
    # A text that cannot fit whatever its tokens is refused before it is tokenized.
    r = server.post("/generate", json={"text": "x" * 2_000_000, "sampling_params": OK_SP})
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]


def test_bad_requests_leave_the_server_serving(server):
    before = server.metric("sglang:num_bad_requests_total")
    for _ in range(3):
        assert server.post("/generate", data=b"{", headers=JSON).status_code == 400
    assert server.metric("sglang:num_bad_requests_total") == before + 3
    r = server.post("/generate", json={"text": "a", "sampling_params": OK_SP})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    state = server.wait_idle()
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    )


def test_duplicate_running_rid_is_400(server):
    body = {
        "text": "a",
        "rid": "dup",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    r = server.post("/generate", json=body, stream=True)
    lines = r.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    second = server.post("/generate", json={**body, "stream": False})
    assert second.status_code == 400
    assert "duplicate request id 'dup'" in second.json()["error"]["message"]
    r.close()
    server.post("/abort_request", json={"rid": "dup"})
    server.wait_idle()


def test_abort_request_needs_a_rid(server):
    r = server.post("/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


CHAT = [{"role": "user", "content": "hi"}]
OPENAI_CASES = {
    "out-of-vocab-ids": (
        "/v1/completions",
        {"model": "tiny-mtp", "prompt": [1, -1]},
        "input_ids must be integers in",
    ),
    "out-of-vocab-id-batch": (
        "/v1/completions",
        {"model": "tiny-mtp", "prompt": [[1, 2], [10**9]]},
        "input_ids must be integers in",
    ),
    "malformed-regex-v1": (
        "/v1/completions",
        {"model": "tiny-mtp", "prompt": "a", "regex": "(a|b"},
        "invalid regex",
    ),
    "unknown-field": (
        "/v1/chat/completions",
        {"model": "tiny-mtp", "messages": CHAT, "max_tokenz": 3},
        "max_tokenz is not supported",
    ),
    "top-logprobs-over-cap": (
        "/v1/chat/completions",
        {"model": "tiny-mtp", "messages": CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "malformed-json": ("/v1/completions", b"{", "not valid JSON"),
    "max-tokens-type": (
        "/v1/completions",
        {"model": "tiny-mtp", "prompt": "a", "max_tokens": "x"},
        "max_tokens",
    ),
    "no-prompt": ("/v1/completions", {"model": "tiny-mtp"}, "prompt: Field required"),
    "empty-messages": ("/v1/chat/completions", {"model": "tiny-mtp", "messages": []}, "messages"),
    "bad-role-content": (
        "/v1/chat/completions",
        {"model": "tiny-mtp", "messages": [{"role": "user", "content": 3}]},
        "content",
    ),
    "unknown-role": (
        "/v1/chat/completions",
        {"model": "tiny-mtp", "messages": [{"role": "bogus", "content": "hi"}]},
        "role",
    ),
    "tools": (
        "/v1/chat/completions",
        {
            "model": "tiny-mtp",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tools is not supported",
    ),
}


@pytest.mark.parametrize("case", list(OPENAI_CASES))
def test_openai_bad_input_is_400(server, case):
    path, body, message = OPENAI_CASES[case]
    r = server.post(path, **_body(body))
    assert r.status_code == 400, r.text
    err = r.json()
    assert message in err["message"]
    assert err["object"] == "error" and err["param"] is None
    assert err["code"] == 400 and err["type"] == "BadRequestError"


def test_openai_null_extension_fields_are_accepted(server):
    body = {"model": "tiny-mtp", "prompt": "a", "max_tokens": 2, "regex": None, "lora_path": None}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/abort_request"])
def test_json_content_type_is_required(server, path):
    """A form or text/plain POST (what a web page can send cross-site) is refused: 415."""
    body = b'{"abort_all": true, "text": "a", "prompt": "a", "model": "tiny-mtp"}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = server.post(path, data=body, headers=headers)
        assert r.status_code == 415, (ctype, r.text)
        err = r.json() if path.startswith("/v1/") else r.json()["error"]
        assert "Content-Type: application/json" in err["message"]
    r = server.post(path, data=b"{}", headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 400  # JSON accepted, then the body is checked


def test_flush_cache_is_post_only(server):
    r = server.get("/flush_cache")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert server.post("/flush_cache", headers={"Content-Type": "text/plain"}).status_code == 415
    server.wait_idle()
    assert server.post("/flush_cache").status_code == 200


def _raw_post(url: str, path: str, headers: dict, body: bytes) -> tuple[int, bytes]:
    """POST over a raw socket (the declared Content-Length may exceed what is sent); returns
    (status, response bytes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_oversized_body_is_413_without_reading_it(server):
    limit = server.get("/server_info").json()["max_request_body_mb"]
    declared = int(limit * (1 << 20)) + 1
    headers = {"Content-Type": "application/json", "Content-Length": str(declared)}
    status, data = _raw_post(server.url, "/generate", headers, b'{"text": "aaaa')
    assert status == 413, data[:300]
    assert b"larger than" in data


def test_huge_text_does_not_stall_health(server):
    """A 20 MB prompt is refused (400) while /health keeps answering."""
    big = {"text": "def f(x):\n    return x\n" * 800_000, "sampling_params": OK_SP}
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=server.post("/generate", json=big)))
    worker.start()
    while worker.is_alive():
        assert requests.get(server.url + "/health", timeout=2).status_code == 200
        time.sleep(0.05)
    worker.join()
    assert result["r"].status_code == 400
    assert "longer than the model's context length" in result["r"].json()["error"]["message"]
