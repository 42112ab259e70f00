"""The prefill-decode pairs of the disaggregation tests: a prefill and a decode server
(Mooncake's transfer engine over TCP, float32, --kv-invariant-check fatal, like conftest's
colocated `server`) with sglang-router 0.3.2 in front (`--pd-disaggregation`), started
together (`_pairs`), and the clients and checks both test modules use
(test_disaggregation.py: outputs against the colocated server; test_disaggregation_faults.py:
aborts, hung peers, killed servers). The pairs' module-scoped fixtures are conftest's."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass

import requests
from e2e_servers import (
    E2E_MODEL,
    REPO,
    ROUTED_PROMPTS,
    Server,
    _wait_healthy,
    child_env,
    free_port,
)

PROMPTS = ROUTED_PROMPTS
GREEDY = {"temperature": 0, "max_new_tokens": 24}
MTP = ("--speculative-algorithm", "MTP", "--speculative-num-steps", "2")
LOGPROB_TOL = 1e-5  # float32, the last bit apart where a GEMM's shape differs


@dataclass
class Pair:
    prefill: Server
    decode: Server
    router: str
    prefill_cmd: list[str]
    bootstrap_port: int


def _server_cmd(port: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "srt_ascend.launch_server", "--model-path", E2E_MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]
    cmd += ["--max-total-tokens", "32768", "--served-model-name", "tiny-mtp"]
    cmd += ["--dtype", "float32", "--kv-invariant-check", "fatal"]
    return cmd + ["--disaggregation-timeout", "20", *extra]


@contextlib.contextmanager
def _processes(cmds: list[tuple[list[str], str | None]], log_dir):
    """Starts every command at once (the servers load side by side), yields their Server
    handles once each answers /health (None for `url` None: the router, checked by the
    caller), stops them all afterwards."""
    procs = []
    log_dir.mkdir(exist_ok=True)
    try:
        for i, (cmd, _) in enumerate(cmds):
            log_path = log_dir / f"proc{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO
                )
            procs.append((proc, log_path))
        handles = []
        for (proc, log_path), (_, url) in zip(procs, cmds):
            if url is None:
                handles.append(None)
                continue
            _wait_healthy(proc, url, log_path)
            handles.append(Server(url, E2E_MODEL, proc, log_path))
        yield handles, procs
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_router(proc, url: str, log_path) -> None:
    """Until the router answers a request end to end (it registers both workers first)."""
    deadline = time.monotonic() + 60
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text(errors="replace")
        with contextlib.suppress(requests.ConnectionError):
            if requests.post(url + "/generate", json=body, timeout=30).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError("the router never served:\n" + log_path.read_text(errors="replace"))


def _prefill_cmd(port: int, boot: int, *extra: str) -> list[str]:
    cmd = _server_cmd(port, "--disaggregation-mode", "prefill", *extra)
    return cmd + ["--disaggregation-bootstrap-port", str(boot)]


@contextlib.contextmanager
def _pairs(log_dir, specs: list[tuple[tuple[str, ...], tuple[str, ...]]]):
    """Pairs of (args of both servers, the decode server's own), each with its router; the
    servers all load at once, the routers start once they answer (a router gives up on
    workers that do not answer in time)."""
    plans, servers, routers = [], [], []
    for extra, decode_extra in specs:
        p_port, d_port, boot, r_port = free_port(), free_port(), free_port(), free_port()
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        router += ["--prefill", p_url, str(boot), "--decode", d_url, "--host", "127.0.0.1"]
        router += ["--port", str(r_port), "--prometheus-port", str(free_port())]
        # a worker back after a failure is taken back within seconds (the circuit breaker
        # otherwise keeps it out for 60 s once 10 requests to it failed)
        router += ["--health-check-interval-secs", "2", "--cb-timeout-duration-secs", "3"]
        routers.append((router, None))
        prefill = _prefill_cmd(p_port, boot, *extra)
        decode = _server_cmd(d_port, "--disaggregation-mode", "decode", *extra, *decode_extra)
        servers += [(prefill, p_url), (decode, d_url)]
        plans.append((prefill, boot, f"http://127.0.0.1:{r_port}"))
    with _processes(servers, log_dir) as (handles, _):
        with _processes(routers, log_dir / "routers") as (_, procs):
            pairs = []
            for i, (prefill, boot, url) in enumerate(plans):
                _wait_router(procs[i][0], url, procs[i][1])
                pairs.append(Pair(handles[2 * i], handles[2 * i + 1], url, prefill, boot))
            yield pairs


def _generate(url: str, body: dict, stream: bool = False) -> dict:
    """The /generate answer (the last event when streaming, its ids the concatenation)."""
    r = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] is not None
    return events[-1]


def _openai(url: str, route: str, body: dict, stream: bool = False) -> str:
    """The text of choice 0 (concatenated from the deltas when streaming)."""
    r = requests.post(url + route, json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        return c["text"] if "text" in c else c["message"]["content"]
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def _prefills(server: Server) -> int:
    return server.log().count("Prefill batch.")


def _wait_settled(*servers: Server, timeout: float = 30.0) -> None:
    """Until every server is idle with its KV invariant holding and nothing held between
    the servers (the invariant check itself runs only when nothing is)."""
    deadline = time.monotonic() + timeout
    for s in servers:
        while True:
            st = s.internal_state()
            held = sum(v for k, v in st.items() if k.startswith("disagg_"))
            if st["kv_invariant"] == "ok" and held == 0:
                break
            assert time.monotonic() < deadline, f"{s.url} never settled: {st}"
            time.sleep(0.2)
        assert s.proc.poll() is None, s.log()


def _same_history(*servers: Server) -> None:
    """Empties the servers' prefix caches (each settled first), for the seeded comparisons:
    sampling repeats bit for bit only over logits computed alike, and float32 logits after a
    prefix hit differ in their last bits from a whole prompt's on some CPUs (the BLAS
    rounds a row by the GEMM's shape: AVX2 OpenBLAS/oneDNN), while the shared servers'
    caches hold whatever earlier tests sent. Greedy outputs do not depend on it."""
    _wait_settled(*servers)
    for s in servers:
        assert s.post("/flush_cache").status_code == 200, s.url


def _assert_matches_colocated(server: Server, pair, stream: bool) -> None:
    """Greedy PROMPTS through the pair's router as through the colocated server (tokens,
    text, finish reason), with nothing of a prompt computed on the decode server."""
    decode_prefills = _prefills(pair.decode)
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY}
        got = _generate(pair.router, body, stream)
        want = _generate(server.url, body, stream)
        assert got["output_ids"] == want["output_ids"], prompt
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert _prefills(pair.decode) == decode_prefills  # nothing of a prompt computed there
    _wait_settled(pair.prefill, pair.decode)
