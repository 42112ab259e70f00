"""One request may ask for at most --max-prompts-per-request generations (prompts of a batch
times n, default 4096): more get HTTP 400 naming the limit, before anything is tokenized or
queued, on /generate and /v1/completions alike; a batch at the limit runs, and a client
that leaves it has all its requests aborted while the server keeps serving."""

from __future__ import annotations

import requests

LIMIT = 4096
OK_SP = {"max_new_tokens": 1, "temperature": 0}


def _refused(r: requests.Response, asked: int, openai: bool = False) -> None:
    assert r.status_code == 400, r.text[:300]
    message = r.json()["message"] if openai else r.json()["error"]["message"]
    assert f"asks for {asked} generations" in message, message
    assert f"at most {LIMIT}" in message and "--max-prompts-per-request" in message, message


def test_too_many_prompts_is_400(server):
    body = {"input_ids": [[5, 6]] * (LIMIT + 1), "sampling_params": OK_SP}
    _refused(server.post("/generate", json=body), LIMIT + 1)


def test_prompts_times_n_counts(server):
    prompts, n = LIMIT // 64 + 1, 64  # each within its own bound (n <= 64), the product past
    body = {"text": ["a"] * prompts, "sampling_params": {**OK_SP, "n": n}}
    _refused(server.post("/generate", json=body), prompts * n)


def test_too_many_completion_prompts_is_400(server):
    body = {"model": "tiny-mtp", "prompt": ["a"] * (LIMIT + 1), "max_tokens": 1}
    _refused(server.post("/v1/completions", json=body), LIMIT + 1, openai=True)


def test_a_left_batch_at_the_limit_is_aborted_and_the_server_serves(server):
    body = {"input_ids": [[5, 6, 7]] * LIMIT, "sampling_params": {"max_new_tokens": 64}}
    try:
        requests.post(server.url + "/generate", json=body, timeout=3)
    except requests.exceptions.Timeout:
        pass  # the client leaves: every request of the batch is aborted
    assert server.get("/health_generate").status_code == 200
    state = server.wait_idle(timeout=120)
    assert state["num_queue_reqs"] == 0 and state["num_running_reqs"] == 0
