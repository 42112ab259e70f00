"""Abort storms and overload, MTP on, a KV pool too small for the load (so requests are
retracted): clients leave mid-stream, others are aborted by rid, the rest finish with their
exact token count; past --max-running-requests + --max-queued-requests new requests get 503
(counted in /metrics); once idle every KV slot is free or cached, none leaked."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from tests.e2e.conftest import running_server

MAX_RUNNING, MAX_QUEUED = 4, 8
SERVER_ARGS = (
    "--speculative-algorithm",
    "MTP",
    "--speculative-num-steps",
    "2",
    "--max-total-tokens",
    "400",
    "--max-running-requests",
    str(MAX_RUNNING),
    "--max-queued-requests",
    str(MAX_QUEUED),
)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def "]


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("overload"), *SERVER_ARGS) as s:
        yield s


FINISH_TOKENS = 120  # four of these overflow the pool: requests are retracted


def _stream(url: str, rid: str, max_new: int, leave_after: int | None, out: dict, started) -> None:
    """One streaming /generate; records (status, last output, chunks seen) under `rid` and
    sets `started` at the first chunk (or when refused)."""
    body = {
        "text": PROMPTS[int(rid.rsplit("-", 1)[1]) % len(PROMPTS)],
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.7},
    }
    last, seen = None, 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        if r.status_code != 200:
            out[rid] = (r.status_code, r.json(), 0)
            started.set()
            return
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            last = json.loads(line[6:])
            seen += 1
            started.set()
            if leave_after is not None and seen >= leave_after:
                break  # leaving the `with` closes the connection mid-stream
    out[rid] = (200, last, seen)
    started.set()


def test_abort_storm_and_overload_leak_nothing(small_server):
    url = small_server.url
    rejected_before = small_server.metric("sglang:num_rejected_requests_total")
    out: dict = {}
    plan = {}  # rid -> (max_new_tokens, leave_after)
    for i in range(15):
        kind = ("finish", "leave", "abort")[i % 3]
        plan[f"{kind}-{i}"] = (FINISH_TOKENS if kind == "finish" else 2000, 3)
        if kind != "leave":
            plan[f"{kind}-{i}"] = (plan[f"{kind}-{i}"][0], None)
    started = {rid: threading.Event() for rid in plan}
    threads = [
        threading.Thread(target=_stream, args=(url, rid, n, leave, out, started[rid]))
        for rid, (n, leave) in plan.items()
    ]
    for t in threads:
        t.start()
    for rid in [r for r in plan if r.startswith("abort")]:
        assert started[rid].wait(120)
        assert small_server.post("/abort_request", json={"rid": rid}).status_code == 200
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()

    rejected = [rid for rid, (status, _, _) in out.items() if status == 503]
    for rid in rejected:
        assert "queue is full" in out[rid][1]["error"]["message"]
    assert len(rejected) <= len(plan) - (MAX_RUNNING + MAX_QUEUED)
    for rid, (status, last, _) in out.items():
        if status != 200:
            continue
        meta = last["meta_info"]
        if rid.startswith("finish"):
            assert meta["finish_reason"]["type"] == "length", (rid, meta)
            assert meta["completion_tokens"] == FINISH_TOKENS == len(last["output_ids"])
        elif rid.startswith("abort"):
            assert meta["finish_reason"]["type"] == "abort", (rid, meta)
            assert meta["completion_tokens"] < 2000

    state = small_server.wait_idle(timeout=60)
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    ), state
    assert state["num_retractions"] > 0
    metric = small_server.metric("sglang:num_rejected_requests_total")
    assert metric - rejected_before == len(rejected)


def test_queue_full_is_503_and_counted(small_server):
    """With MAX_RUNNING + MAX_QUEUED long requests in flight the next one gets 503."""
    url = small_server.url
    before = small_server.metric("sglang:num_rejected_requests_total")
    streams = []
    for i in range(MAX_RUNNING + MAX_QUEUED):
        body = {
            "text": "a",
            "rid": f"hold-{i}",
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        streams.append(requests.post(url + "/generate", json=body, stream=True, timeout=60))
    try:
        assert all(r.status_code == 200 for r in streams)
        r = small_server.post("/generate", json={"text": "a", "sampling_params": {}})
        assert r.status_code == 503
        assert "queue is full" in r.json()["error"]["message"]
        r = small_server.post("/v1/completions", json={"model": "tiny-mtp", "prompt": "a"})
        assert r.status_code == 503 and r.json()["code"] == 503
        assert small_server.metric("sglang:num_rejected_requests_total") == before + 2
    finally:
        for r in streams:
            r.close()
        small_server.post("/abort_request", json={"abort_all": True})
    state = small_server.wait_idle(timeout=60)
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    ), state
