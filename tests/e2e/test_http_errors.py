"""Bad input gets HTTP 400 with a message (SGLang's {"error": {"message"}} on the native API,
OpenAI's {"error": {"message", "type", "code"}} on /v1), and the server keeps serving."""

from __future__ import annotations

import pytest

OK_SP = {"max_new_tokens": 2, "temperature": 0}

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
    "unsupported-regex": (
        {"text": "a", "sampling_params": {"regex": "[0-9]+"}},
        "sampling_params.regex is not supported",
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
}


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_bad_input_is_400(server, case):
    body, message = NATIVE_CASES[case]
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    r = server.post("/generate", **kw)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_prompt_longer_than_context(server):
    ctx = server.get("/model_info").json()["context_length"]
    r = server.post("/generate", json={"input_ids": [5] * (ctx + 1), "sampling_params": OK_SP})
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]
    r = server.post("/v1/completions", json={"model": "m", "prompt": [5] * (ctx + 1)})
    assert r.status_code == 400
    assert "context length" in r.json()["error"]["message"]


def test_bad_requests_leave_the_server_serving(server):
    before = server.metric("sglang:num_bad_requests_total")
    for _ in range(3):
        assert server.post("/generate", data=b"{").status_code == 400
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


OPENAI_CASES = {
    "malformed-json": ("/v1/completions", b"{", "not valid JSON"),
    "max-tokens-type": (
        "/v1/completions",
        {"model": "m", "prompt": "a", "max_tokens": "x"},
        "max_tokens",
    ),
    "no-prompt": ("/v1/completions", {"model": "m"}, "prompt: Field required"),
    "empty-messages": ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    "bad-role-content": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": 3}]},
        "content",
    ),
    "tools": (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tools is not supported",
    ),
}


@pytest.mark.parametrize("case", list(OPENAI_CASES))
def test_openai_bad_input_is_400(server, case):
    path, body, message = OPENAI_CASES[case]
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    r = server.post(path, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
