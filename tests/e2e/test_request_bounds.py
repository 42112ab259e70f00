"""No request may stall the server: a catastrophic stop_regex is matched in linear time while
/health keeps answering, a huge chat is refused before it is parsed or templated, and bounds
on `n`, score items and odd inputs answer 400 naming the limit."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import requests
from transformers import AutoTokenizer

from tests.e2e.conftest import E2E_MODEL

# /health must answer within this while another request works (the stalls were 2.6 s to
# minutes; an answer normally takes milliseconds, a loaded 2-core machine adds some)
HEALTH_BOUND_S = 2.0


@contextmanager
def health_latency(server):
    """Polls /health in a thread while the body runs; yields the list of latencies."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            requests.get(server.url + "/health", timeout=120)
            latencies.append(time.monotonic() - start)
            done.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join(timeout=130)


@pytest.fixture(scope="module")
def a_token() -> int:
    ids = AutoTokenizer.from_pretrained(E2E_MODEL).encode("a", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_catastrophic_stop_regex_does_not_stall(server, a_token):
    """(a|aa)*c over an output of 64 `a`s (forced by logit_bias) backtracks for ages in a
    backtracking engine (39 `a`s took 42 s and held /health 16 s); with RE2 the request ends
    by length at once and /health answers meanwhile."""
    sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    sp |= {"logit_bias": {str(a_token): 100}, "stop_regex": "(a|aa)*c"}
    with health_latency(server) as latencies:
        start = time.monotonic()
        body = {"text": "x", "sampling_params": sp}
        r = requests.post(server.url + "/generate", json=body, timeout=30)
        took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "a" * 64
    assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert took < 20 and max(latencies) < HEALTH_BOUND_S, (took, max(latencies))


def test_stop_regex_matched_is_the_pattern(server, a_token):
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    sp |= {"logit_bias": {str(a_token): 100}, "stop_regex": ["b", "a{3}"]}
    r = server.post("/generate", json={"text": "x", "sampling_params": sp})
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "a{3}"}
    assert r.json()["text"] == "" and r.json()["meta_info"]["completion_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "temperature": 0}
    chat |= {"logit_bias": {str(a_token): 100}, "stop_regex": "a{2}", "ignore_eos": True}
    choice = server.post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", "a{2}")


@pytest.mark.parametrize(
    "route, body, message",
    [
        (
            "/generate",
            {"text": "a", "sampling_params": {"stop_regex": "(a)\\1"}},
            "not a valid regex for RE2",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "stop_regex": "(?<=a)b"},
            "not a valid regex for RE2",
        ),
        ("/generate", {"text": "a", "sampling_params": {"n": 65}}, "at most 64"),
        ("/generate", {"text": "a", "sampling_params": {"n": [2]}}, "sampling_params.n must"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"logit_bias": {"+10": 1}}},
            "logit_bias keys must be token ids",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"1_0": 1}},
            "logit_bias keys must be token ids",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "assistant", "content": "a"}],
                "continue_final_message": "true",
            },
            "continue_final_message: Input should be a valid boolean",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}],
                "chat_template_kwargs": {"chat_template": "{{ 'pwned' }}"},
            },
            "chat_template_kwargs.chat_template is not supported",
        ),
        (
            "/v1/score",
            {"query": [], "items": [[]], "label_token_ids": [1]},
            "query + item is empty",
        ),
        (
            "/v1/score",
            {"query": "q", "items": ["i"] * 1025, "label_token_ids": [1]},
            "at most 1024",
        ),
    ],
)
def test_bounds_and_odd_inputs_are_400(server, route, body, message):
    r = server.post(route, json=body)
    assert r.status_code == 400, r.text
    got = r.json()
    got = got["error"]["message"] if "error" in got else got["message"]
    assert message in got


def test_huge_chat_is_refused_before_it_stalls_the_loop(server):
    """400,000 messages (12 MB) were parsed and templated on the event loop (/health held
    2.6 s, more on a loaded machine); now the count is refused before either."""
    ctx = server.get("/model_info").json()["context_length"]
    body = {"messages": [{"role": "user", "content": "hi"}] * 400_000, "max_tokens": 1}
    with health_latency(server) as latencies:
        r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert (
        f"400000 messages cannot fit the model's context length ({ctx} tokens)"
        in (r.json()["message"])
    )
    assert max(latencies) < HEALTH_BOUND_S, max(latencies)
