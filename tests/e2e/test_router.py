"""sglang-router (the Rust router SGLang users put in front of several servers) routes to two
srt_ascend servers: the shared server and one more. Requests on /generate and
/v1/chat/completions come back as the servers answer them directly, and both servers take
requests. The test runs the router's round_robin policy: with cache_aware, 0.3.2 sent every
request of some runs to one worker (its choice, not the servers'), which would make "both
servers take requests" a coin toss."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests
from e2e_servers import ROUTED_PROMPTS, child_env, free_port, running_server

PROMPTS = ROUTED_PROMPTS
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("router_worker")) as s:
        yield s


@pytest.fixture(scope="module")
def router(server, second_server, tmp_path_factory) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls"]
    cmd += [server.url, second_server.url, "--policy", "round_robin"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(proc, url, 2, log_path)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_for_workers(proc, url: str, n: int, log_path) -> None:
    """Until the router has registered `n` workers (it checks each one's info endpoints)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text(errors="replace")
        try:
            if requests.get(url + "/get_server_info", timeout=2).json().get("workers_count") == n:
                return
        except (requests.ConnectionError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"router has not registered {n} workers:\n{log_path.read_text()}")


def _generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": GREEDY}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_through_the_router(server, second_server, router):
    expected = [_generate(server.url, p)["output_ids"] for p in PROMPTS]
    served = second_server.log().count("Prefill batch.")
    assert [_generate(router, p)["output_ids"] for p in PROMPTS] == expected
    assert second_server.log().count("Prefill batch.") > served  # round robin: it served too


def test_chat_through_the_router(server, router):
    body = {
        "model": "tiny-mtp",
        "messages": [{"role": "user", "content": "Write a haiku about caches."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    direct = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    routed = requests.post(router + "/v1/chat/completions", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    content = routed.json()["choices"][0]["message"]["content"]
    assert content == direct.json()["choices"][0]["message"]["content"]
