"""--api-key / --admin-api-key (SGLang's rules: Bearer on every endpoint but /health* and
/metrics; the admin key alone opens /flush_cache), and graceful shutdown: on SIGTERM new
requests get 503, running ones have --shutdown-timeout seconds, the rest end with
finish_reason abort, and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import openai
import pytest
import requests

from tests.e2e.conftest import running_server

KEY, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    args = ("--api-key", KEY, "--admin-api-key", ADMIN, "--shutdown-timeout", "1")
    with running_server(tmp_path_factory.mktemp("keyed"), *args) as s:
        yield s


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


GEN = {"text": "a", "sampling_params": {"max_new_tokens": 2}}


def test_api_key_is_required(keyed_server):
    s = keyed_server
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
        r = s.post("/generate", json=GEN, headers=headers)
        assert r.status_code == 401, r.text
        assert "API key" in r.json()["error"]["message"]
        r = s.post("/v1/completions", json={"model": "tiny-mtp", "prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["code"] == 401
        assert s.get("/server_info", headers=headers).status_code == 401
        assert s.get("/v1/models", headers=headers).status_code == 401
    assert s.post("/generate", json=GEN, headers=_auth(KEY)).status_code == 200
    assert s.get("/model_info", headers=_auth(KEY)).status_code == 200
    # Probes and scrapers need no key.
    assert s.get("/health").status_code == 200
    assert s.get("/health_generate").status_code == 200
    assert s.get("/metrics").status_code == 200


def test_admin_key_alone_opens_admin_endpoints(keyed_server):
    s = keyed_server
    assert s.post("/flush_cache", headers=_auth(KEY)).status_code == 401
    assert s.post("/flush_cache").status_code == 401
    assert s.post("/flush_cache", headers=_auth(ADMIN)).status_code == 200
    # The admin key is not the API key.
    assert s.post("/generate", json=GEN, headers=_auth(ADMIN)).status_code == 401


def test_openai_client_sends_the_key(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY)
    out = good.completions.create(model="tiny-mtp", prompt="def f(", max_tokens=3)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-mtp", prompt="def f(", max_tokens=3)


def _stream_until_end(url: str, body: dict, out: list) -> None:
    last = None
    with requests.post(url, json=body, headers=_auth(KEY), stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
                if len(out) == 0:
                    out.append("started")
    out.append(last)


def test_sigterm_drains_then_aborts_and_exits(tmp_path):
    """Runs last in this module (its own server): short requests finish within the timeout,
    long ones end with finish_reason abort, and the process exits 0 soon after."""
    args = ("--api-key", KEY, "--shutdown-timeout", "2")
    with running_server(tmp_path, *args) as s:
        long_body = {
            "text": "def f(",
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        short_body = {**long_body, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
        results = {"long": [], "short": []}
        threads = [
            threading.Thread(target=_stream_until_end, args=(s.url + "/generate", b, results[k]))
            for k, b in (("long", long_body), ("short", short_body))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(results.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: no new work, and probes say so.
        assert s.get("/health").status_code == 503
        assert s.get("/ready", headers=_auth(KEY)).status_code == 503
        r = s.post("/generate", json=GEN, headers=_auth(KEY))
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        for t in threads:
            t.join(timeout=60)
        assert s.proc.wait(timeout=30) == 0, s.log()[-3000:]
        elapsed = time.monotonic() - start
        short, long = results["short"][-1], results["long"][-1]
        assert short["meta_info"]["finish_reason"]["type"] == "length"
        assert short["meta_info"]["completion_tokens"] == 30
        assert long["meta_info"]["finish_reason"]["type"] == "abort"
        assert long["meta_info"]["finish_reason"]["message"] == "the server is shutting down"
        assert long["meta_info"]["completion_tokens"] < 3000
        assert 2 <= elapsed < 25, elapsed
        assert "aborting the 1 requests still in flight" in s.log()
