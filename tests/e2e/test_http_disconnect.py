"""A client that disconnects mid-stream aborts its request, and its KV slots come back."""

from __future__ import annotations

import json
import time

import requests

LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _read_chunks_then_drop(url: str, body: dict, n: int) -> None:
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                json.loads(line[6:])
                seen += 1
                if seen == n:
                    break
    # leaving the `with` closes the socket mid-stream


def _wait_aborted(server, before: float) -> None:
    deadline = time.monotonic() + 30
    while server.metric("sglang:num_aborted_requests_total") < before + 1:
        assert time.monotonic() < deadline, "the dropped request was never aborted"
        time.sleep(0.1)


def test_native_stream_disconnect_aborts_and_frees_kv(server):
    aborted = server.metric("sglang:num_aborted_requests_total")
    generated = server.metric("sglang:generation_tokens_total")
    body = {"text": "def fibonacci(n):\n", "sampling_params": LONG, "stream": True}
    _read_chunks_then_drop(server.url + "/generate", body, n=3)
    _wait_aborted(server, aborted)
    server.wait_idle()
    assert server.metric("sglang:generation_tokens_total") - generated < 3000
    # Nothing runs, so the cache can be flushed, and then every slot is free.
    assert server.post("/flush_cache").status_code == 200
    state = server.internal_state()
    assert state["cached_tokens_in_tree"] == 0
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]


def test_openai_stream_disconnect_aborts(server):
    aborted = server.metric("sglang:num_aborted_requests_total")
    body = {
        "model": "tiny-mtp",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }
    _read_chunks_then_drop(server.url + "/v1/chat/completions", body, n=2)
    deadline = time.monotonic() + 30
    while server.metric("sglang:num_aborted_requests_total") < aborted + 2:
        assert time.monotonic() < deadline, "the dropped choices were never aborted"
        time.sleep(0.1)
    state = server.wait_idle()
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    )


def test_non_streaming_disconnect_aborts(server):
    aborted = server.metric("sglang:num_aborted_requests_total")
    body = {"text": ["a", "b"], "sampling_params": LONG}
    try:
        requests.post(server.url + "/generate", json=body, timeout=(5, 1.0))
        raise AssertionError("a 3000-token request answered within 1 s")
    except requests.ReadTimeout:
        pass  # the client gave up and closed the connection
    deadline = time.monotonic() + 30
    while server.metric("sglang:num_aborted_requests_total") < aborted + 2:
        assert time.monotonic() < deadline, "the abandoned batch was never aborted"
        time.sleep(0.1)
    state = server.wait_idle()
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == (state["max_total_num_tokens"])
    )
    # One log line for the client that left, no traceback.
    log = server.log()
    assert "client left before the answer to POST /generate" in log
    assert "CancelledError" not in log and "Exception in ASGI application" not in log
