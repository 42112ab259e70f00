"""Prefill-decode disaggregation behind sglang-router 0.3.2 (`--pd-disaggregation`), on CPU
with Mooncake's transfer engine over TCP: one prefill and one decode server, MTP off and
K = 2, against one colocated server (conftest's `server`, float32 like them). Greedy outputs
are token-identical on /generate, /v1/completions and /v1/chat/completions, streaming or
not; logprobs agree; the decode server never computes a prompt; bad bootstrap fields get
HTTP 400; a client that leaves mid-stream leaves nothing held on either server (both run
--kv-invariant-check fatal, so a broken invariant would end a server). A third pair (MTP,
the decode server on two ranks verifying by expansion) is the one whose servers die; the
router's own timeouts, a hung decode-side engine and a hung prefill server are each a
scenario of their own."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
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


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Pair]:
    """MTP off on both servers; MTP K=2 on both, the decode server verifying with fia (one
    row of 1+K queries; the colocated server's MTP default is expand, and a prefill server
    never verifies)."""
    specs = [((), ()), (MTP, ("--speculative-verify", "fia"))]
    with _pairs(tmp_path_factory.mktemp("pd"), specs) as (plain, mtp):
        yield {"plain": plain, "mtp": mtp}


@pytest.fixture(scope="module")
def plain_pair(pairs) -> Pair:
    return pairs["plain"]


@pytest.fixture(scope="module")
def mtp_pair(pairs) -> Pair:
    return pairs["mtp"]


@pytest.fixture(params=["plain", "mtp"])
def pair(request) -> Pair:
    return request.getfixturevalue(f"{request.param}_pair")


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


# ---- outputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_generate_matches_colocated(server, pair, stream):
    _assert_matches_colocated(server, pair, stream)


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


def test_one_token_and_chunked_prompts_match_colocated(server, pair):
    """A request whose first token is its last (it finishes on the prefill server and is
    still sent: the decode server commits it and stops), and a prompt longer than
    --chunked-prefill-size (1024: prefilled in two chunks, sent once complete)."""
    long_prompt = PROMPTS[3] * 26
    for text, n in ((PROMPTS[0], 1), (long_prompt, 8)):
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
        got, want = _generate(pair.router, body), _generate(server.url, body)
        assert want["meta_info"]["prompt_tokens"] > 1024 or n == 1
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == n
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    _wait_settled(pair.prefill, pair.decode)


def test_parallel_samples_and_batches_match_colocated(server, pair):
    """n > 1 and batches through the router: it sends one room for a prompt's n samples
    (/generate, /v1/completions), one per prompt for a batch, one per choice for chat with
    n > 1; both servers give each generation its own room alike (room + i, as SGLang spreads
    it), so each is one KV transfer: greedy and seeded answers as one server's."""
    greedy = {"temperature": 0, "max_new_tokens": 8}
    for body, stream in (
        ({"text": PROMPTS[0], "sampling_params": {**greedy, "n": 2}}, False),
        ({"text": PROMPTS[1], "sampling_params": {**greedy, "n": 2}}, True),
        ({"input_ids": [[5, 6, 7], [8, 9, 10, 11]], "sampling_params": greedy}, False),
    ):
        got, want = (
            _generate_all(pair.router, body, stream),
            _generate_all(server.url, body, stream),
        )
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want] and len(got) == 2
    # seeded sampling as the colocated server's (MTP off; with MTP only greedy repeats it)
    temperature = 0 if "MTP" in pair.prefill_cmd else 0.8
    seeded = {"model": "tiny-mtp", "max_tokens": 8, "temperature": temperature, "seed": 11, "n": 3}
    chat = {**seeded, "n": 2, "messages": [{"role": "user", "content": PROMPTS[2]}]}
    # each body twice, compared the second time: the first computes the prompt whole on both
    # sides (one server prefills an n > 1 prompt once for its samples, the pair per sample)
    _same_history(server, pair.prefill, pair.decode)
    for route, body in (
        ("/v1/completions", {**seeded, "prompt": PROMPTS[0]}),
        ("/v1/chat/completions", chat),
    ):
        for _ in range(2):
            got = requests.post(pair.router + route, json=body, timeout=120)
            assert got.status_code == 200, got.text
            want = requests.post(server.url + route, json=body, timeout=120).json()
        assert got.json()["choices"] == want["choices"]
    _wait_settled(pair.prefill, pair.decode)


def _generate_all(url: str, body: dict, stream: bool) -> list[dict]:
    """A /generate answer with several generations (the last event of each when streaming)."""
    r = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    last = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            last[event["index"]] = event
    return [last[i] for i in sorted(last)]


def test_prefill_radix_hits_reach_the_client(plain_pair):
    """The prefill server's radix cache serves a repeated prompt; the decode server reports
    its hit as the request's cached_tokens."""
    body = {"text": PROMPTS[2] + " # again", "sampling_params": GREEDY}
    first = _generate(plain_pair.router, body)
    second = _generate(plain_pair.router, body)
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 1
    # tenants: another extra_key (/generate) or cache_salt (/v1/completions; the router drops
    # cache_salt from /generate) does not hit that cache, its own does
    other = _generate(plain_pair.router, {**body, "extra_key": "tenant-b"})["meta_info"]
    assert other["cached_tokens"] <= 1
    salted = {"model": "tiny-mtp", "prompt": body["text"], "max_tokens": 2, "cache_salt": "c"}
    for want_hit in (False, True):
        r = requests.post(plain_pair.router + "/v1/completions", json=salted, timeout=60)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 1) == want_hit, r.text


def test_openai_routes_match_colocated(server, pair):
    for stream in (False, True):
        for prompt in PROMPTS[:2]:
            body = {"model": "tiny-mtp", "prompt": prompt, "max_tokens": 20, "temperature": 0}
            assert _openai(pair.router, "/v1/completions", body, stream) == _openai(
                server.url, "/v1/completions", body, stream
            )
            chat = {
                "model": "tiny-mtp",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 20,
                "temperature": 0,
            }
            assert _openai(pair.router, "/v1/chat/completions", chat, stream) == _openai(
                server.url, "/v1/chat/completions", chat, stream
            )


def _close(got: list, want: list) -> None:
    """Logprob lists ([logprob, id, text] entries, nested lists of them, None) alike: ids
    equal, logprobs within LOGPROB_TOL."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g == w
        elif isinstance(w[0], list):
            _close(g, w)
        else:
            assert g[1:] == w[1:]
            assert (g[0] is None) == (w[0] is None)
            if w[0] is not None:
                assert abs(g[0] - w[0]) <= LOGPROB_TOL, (g, w)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_match_colocated(server, pair, stream):
    """Output and prompt logprobs as one server reports them, streaming or not (the
    prompt's come from the prefill server through the decode server's answer)."""
    body = {
        "text": PROMPTS[2],
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
        "token_ids_logprob": [10, 201],
    }
    got = _generate(pair.router, body, stream)["meta_info"]
    want = _generate(server.url, body, stream)["meta_info"]
    for key in (
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "input_token_ids_logprobs",
    ):
        _close(got[key], want[key])


def test_seeded_sampling_matches_colocated(server, plain_pair):
    """The first token is drawn on the prefill server, the rest on the decode server, each
    from the request's seeded stream at its output length, as on one server."""
    sp = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234, "max_new_tokens": 20}
    _same_history(server, plain_pair.prefill, plain_pair.decode)
    for prompt in PROMPTS[:2]:
        body = {"text": prompt, "sampling_params": sp}
        got = _generate(plain_pair.router, body)["output_ids"]
        assert got == _generate(server.url, body)["output_ids"]


def test_mtp_seeded_sampling_matches_colocated_mtp(mtp_server, mtp_pair):
    """Sampled drafts: d_1's distribution travels with it (the acceptance rule reads it at
    the decode server's first verify step), so seeded MTP sampling repeats a colocated MTP
    server's tokens (K=2 on all three; target logits alike in expand and fia)."""
    # hot enough that a draft's own probability is far from 1: read as one-hot (its
    # distribution lost on the way), the first step's acceptance would differ
    sp = {"temperature": 1.5, "sampling_seed": 77, "max_new_tokens": 16}
    _same_history(mtp_server, mtp_pair.prefill, mtp_pair.decode)
    for prompt in PROMPTS + [p + "\n" for p in PROMPTS]:
        body = {"text": prompt, "sampling_params": sp}
        got = _generate(mtp_pair.router, body)["output_ids"]
        assert got == _generate(mtp_server.url, body)["output_ids"], prompt


def test_mtp_decode_starts_with_verify_steps(mtp_pair):
    before = mtp_pair.decode.internal_state()["spec_num_verify"]
    decode_prefills = _prefills(mtp_pair.decode)
    _generate(mtp_pair.router, {"text": PROMPTS[0], "sampling_params": GREEDY})
    st = mtp_pair.decode.internal_state()
    assert st["spec_num_verify"] > before and st["avg_spec_accept_length"] > 1.0
    assert _prefills(mtp_pair.decode) == decode_prefills


def test_transfer_metrics(plain_pair):
    _generate(plain_pair.router, {"text": PROMPTS[3], "sampling_params": GREEDY})
    assert plain_pair.prefill.metric("sglang:kv_transfer_bytes_total") > 0
    assert plain_pair.prefill.metric("sglang:kv_transfer_seconds_total") > 0
    assert plain_pair.prefill.metric("sglang:kv_transfer_failures_total") == 0


# ---- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_bootstrap_fields_missing_or_wrong_get_400(plain_pair, role):
    s = getattr(plain_pair, role)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    r = s.post("/generate", json=body)
    assert r.status_code == 400 and "bootstrap_room" in r.text
    bad = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": "x"}
    r = s.post("/generate", json=bad)
    assert r.status_code == 400 and "bootstrap_room must be an integer" in r.text
    r = s.post("/v1/completions", json={"model": "tiny-mtp", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "bootstrap_room" in r.text
    two = {**body, "text": ["a", "b"], "bootstrap_host": "127.0.0.1"}
    two.update(bootstrap_port=1, bootstrap_room=[7, 8, 9])  # one room per prompt, or none
    r = s.post("/generate", json=two)
    assert r.status_code == 400 and "bootstrap_room has 3 entries" in r.text


def test_client_abort_frees_both_servers(server, pair):
    """Clients that leave mid-stream, and right after sending: both servers end the requests
    and give back their rows and slots (the invariant check passes), then serve on."""
    body = {"text": PROMPTS[3], "sampling_params": {**GREEDY, "max_new_tokens": 400}}
    for _ in range(3):
        with requests.post(
            pair.router + "/generate", json={**body, "stream": True}, stream=True, timeout=60
        ) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event: the request runs on the decode server
    with contextlib.suppress(requests.Timeout):  # gone before the prefill is done
        requests.post(pair.router + "/generate", json=body, timeout=0.05)
    _wait_settled(pair.prefill, pair.decode)
    greedy = {"text": PROMPTS[0], "sampling_params": GREEDY}
    assert (
        _generate(pair.router, greedy)["output_ids"] == _generate(server.url, greedy)["output_ids"]
    )
    _wait_settled(pair.prefill, pair.decode)


def test_mismatched_registration_fails_on_both_sides(plain_pair):
    """A registration whose prompt digest does not match the prefill request (two servers
    that tokenized differently): the request ends with an abort naming it, the registration
    is answered with it, and the prefill server frees the request's KV."""
    room = 987654321
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": plain_pair.bootstrap_port}
    body = {"text": PROMPTS[1], "sampling_params": GREEDY, **fields, "bootstrap_room": room}
    dest = {
        "room": room, "session": "127.0.0.1:1", "prompt_len": 1, "digest": "x", "slots": [1],
        "buffers": [1], "row_bytes": [1], "num_main": 1,
    }  # fmt: skip
    boot = f"http://127.0.0.1:{plain_pair.bootstrap_port}/disagg/kv"
    with ThreadPoolExecutor(1) as pool:
        registered = pool.submit(requests.post, boot, json=dest, timeout=60)
        out = plain_pair.prefill.post("/generate", json=body).json()
        answer = registered.result()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "tokenized the prompt differently" in out["meta_info"]["finish_reason"]["message"]
    assert answer.status_code == 500 and "tokenized the prompt differently" in answer.text
    assert plain_pair.prefill.metric("sglang:kv_transfer_failures_total") >= 1
    _wait_settled(plain_pair.prefill)


def test_abort_storm_leaves_nothing_held(server, plain_pair):
    """Clients leaving at every stage (queued, prefilling, held for the registration,
    decoding), many at once."""
    body = {"text": PROMPTS[3] * 3, "sampling_params": {**GREEDY, "max_new_tokens": 300}}

    def leave_after(seconds: float) -> None:
        with contextlib.suppress(requests.RequestException):
            requests.post(plain_pair.router + "/generate", json=body, timeout=seconds)

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(leave_after, [0.02 * 1.6**i for i in range(12)]))
    _wait_settled(plain_pair.prefill, plain_pair.decode, timeout=60)
    greedy = {"text": PROMPTS[2], "sampling_params": GREEDY}
    want = _generate(server.url, greedy)["output_ids"]
    assert _generate(plain_pair.router, greedy)["output_ids"] == want


def test_router_timeout_abort_storm_leaves_nothing_held(server, plain_pair, tmp_path):
    """sglang-router 0.3.2 has no abort route (`/abort_request` and `/abort` answer 404): its
    own aborts are its --request-timeout-secs, which drops both servers' requests (and
    retries a non-streaming one, with a new room, up to --retry-max-retries times). A storm
    of such timeouts, streaming and not, through a second router over the same servers:
    each client gets an error or a cut stream, both servers end and free everything."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    cmd += ["--prefill", plain_pair.prefill.url, str(plain_pair.bootstrap_port)]
    cmd += ["--decode", plain_pair.decode.url, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-port", str(free_port()), "--request-timeout-secs", "1"]
    cmd += ["--retry-max-retries", "2"]
    body = {"text": PROMPTS[3] * 3, "sampling_params": {**GREEDY, "max_new_tokens": 1000}}
    body["sampling_params"]["ignore_eos"] = True

    def timed_out(stream: bool) -> str:
        try:
            r = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=120)
        except requests.RequestException as e:  # a stream the router cut
            return type(e).__name__
        return f"status {r.status_code}" if r.status_code != 200 else r.text[-200:]

    with _processes([(cmd, None)], tmp_path) as (_, procs):
        url = f"http://127.0.0.1:{port}"
        _wait_router(procs[0][0], url, procs[0][1])
        for route in ("/abort_request", "/abort"):
            assert requests.post(url + route, json={"rid": ""}, timeout=30).status_code == 404
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(timed_out, [False, True] * 4))
    assert all(o.startswith("status 5") or o.endswith("Error") for o in outcomes), outcomes
    _wait_settled(plain_pair.prefill, plain_pair.decode, timeout=60)
    greedy = {"text": PROMPTS[1], "sampling_params": GREEDY}
    want = _generate(server.url, greedy)["output_ids"]
    assert _generate(plain_pair.router, greedy)["output_ids"] == want
    _wait_settled(plain_pair.prefill, plain_pair.decode)


class _HungPeer:
    """A TCP listener that accepts and never answers: a decode server whose transfer engine
    hangs (a write to its session waits in the handshake until `close`)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.session = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class _Relay:
    """A bootstrap endpoint in front of a prefill server's that passes every request on,
    with each registration's transfer-engine sessions changed to `session`."""

    def __init__(self, boot_port: int, session: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/disagg/kv":
                    body["session"] = session
                    for peer in body["peers"]:
                        peer["session"] = session
                conn = http.client.HTTPConnection("127.0.0.1", boot_port)
                conn.request("POST", self.path, json.dumps(body))
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_hung_transfer_does_not_stall_the_prefill_scheduler(server, plain_pair):
    """A request whose decode server's transfer engine hangs (its registration relayed with
    the session of a peer that accepts and never answers): while its KV transfer waits on
    the prefill server's transfer thread, the prefill scheduler goes on: another request
    through the same prefill server is prefilled and queued for sending (ordering, not
    timing: both are in flight at once). Mooncake's engine serializes segment handshakes in
    the process, so that one's transfer waits for the hung handshake; once the peer goes,
    the hung request fails on both servers, the other is sent and answered as a colocated
    server answers it, and both servers free everything."""
    pair, peer = plain_pair, _HungPeer()
    relay = _Relay(pair.bootstrap_port, peer.session)
    try:
        room = 4242424242
        body = {"text": PROMPTS[1], "sampling_params": GREEDY, "bootstrap_room": room}
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=pair.bootstrap_port)
        greedy = {"text": PROMPTS[2] + "\n", "sampling_params": GREEDY}
        want = _generate(server.url, greedy)["output_ids"]
        with ThreadPoolExecutor(3) as pool:
            hung = pool.submit(pair.prefill.post, "/generate", json=body)
            body = {**body, "bootstrap_port": relay.port}  # the decode server registers there
            hung_decode = pool.submit(pair.decode.post, "/generate", json=body)
            _wait_for(lambda: peer.conns, "the transfer never started")
            prefills = _prefills(pair.prefill)
            other = pool.submit(_generate, pair.router, greedy)
            _wait_for(lambda: _prefills(pair.prefill) > prefills, "no prefill meanwhile", 120)
            assert not hung.done() and not hung_decode.done()
            sending = lambda: pair.prefill.internal_state()["disagg_sending_reqs"]  # noqa: E731
            _wait_for(lambda: sending() == 2, "the other request was not queued meanwhile")
            assert not hung.done() and not other.done()
            # their KV, radix-cache nodes and all, stays theirs while it is being sent
            assert pair.prefill.post("/flush_cache").status_code == 400
            peer.close()  # the hung transfer fails now
            out, out_decode = hung.result().json(), hung_decode.result().json()
            assert other.result()["output_ids"] == want
    finally:
        peer.close()
        relay.close()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "KV transfer" in reason["message"], reason
    reason = out_decode["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "did not send the KV" in reason["message"], reason
    _wait_settled(pair.prefill, pair.decode)


@pytest.fixture(scope="module")
def fragile_pair(tmp_path_factory):
    """A pair whose prefill server a test kills (and starts again): MTP K=2 on both, the
    decode server verifying by batch expansion (the other MTP pair's verifies with fia) on
    two tensor-parallel ranks (each rank's pool gets the prompt's whole latent KV);
    --disaggregation-timeout 3 on both (the decode server waits 4 x 3 s for an answer)."""
    both = (*MTP, "--disaggregation-timeout", "3")
    specs = [(both, ("--speculative-verify", "expand", "--tp-size", "2"))]
    with _pairs(tmp_path_factory.mktemp("pd_fragile"), specs) as (pair,):
        yield pair


@pytest.mark.parametrize("stream", [False, True])
def test_tp2_mtp_expand_decode_matches_colocated(server, fragile_pair, stream):
    """A decode server with --tp-size 2 (fed by a prefill server with --tp-size 1: the
    prefill server writes the KV into both ranks' pools) and MTP K=2, its verify steps by
    batch expansion (1+K rows per request): greedy float32 tokens as one colocated server's;
    nothing of a prompt is computed on the decode server; both ranks' KV invariants hold
    (fatal: a broken one ends the server)."""
    pair = fragile_pair
    before = pair.decode.internal_state()["spec_num_verify"]
    _assert_matches_colocated(server, pair, stream)
    assert pair.decode.internal_state()["spec_num_verify"] > before


def test_unanswered_registration_keeps_the_decode_slots(fragile_pair):
    """A prefill server that hangs (its bootstrap endpoint takes the registration and never
    answers): after 4 x --disaggregation-timeout the request ends for its client, but the
    decode server keeps its row and slots (a hung prefill server could still write into
    them) until the prefill server answers or its connection breaks; then it frees them."""
    pair, peer = fragile_pair, _HungPeer()
    host, port = peer.session.split(":")
    try:
        body = {"text": PROMPTS[0], "sampling_params": GREEDY, "bootstrap_room": 777}
        body.update(bootstrap_host=host, bootstrap_port=int(port))
        out = pair.decode.post("/generate", json=body).json()
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "did not answer in 12 s" in reason["message"]
        assert pair.decode.internal_state()["disagg_awaiting_reqs"] == 1  # slots still held
        assert pair.decode.proc.poll() is None
    finally:
        peer.close()  # the registration's connection breaks: the slots are free again
    _wait_settled(pair.decode)


def test_killed_prefill_server_fails_its_requests_cleanly(server, fragile_pair, tmp_path):
    """Requests in flight when the prefill server dies end (an error or an abort, none
    hangs); the decode server frees what they held and, once a prefill server is back on
    the same ports, serves through the router again."""
    pair = fragile_pair
    body = {"text": PROMPTS[3] * 4, "sampling_params": {**GREEDY, "max_new_tokens": 64}}

    def send(_) -> str:
        try:
            r = requests.post(pair.router + "/generate", json=body, timeout=90)
        except requests.RequestException as e:
            return f"error {type(e).__name__}"
        if r.status_code != 200:
            return f"status {r.status_code}"
        return r.json()["meta_info"]["finish_reason"]["type"]

    with ThreadPoolExecutor(6) as pool:
        outcomes = pool.map(send, range(6))
        time.sleep(0.5)
        pair.prefill.proc.kill()
        outcomes = list(outcomes)
    assert outcomes and all(
        o in ("length", "abort") or o.startswith(("status", "error")) for o in outcomes
    )
    _wait_settled(pair.decode, timeout=60)
    url = pair.prefill.url
    with _processes([(pair.prefill_cmd, url)], tmp_path) as (servers, _):
        greedy = {"text": PROMPTS[0], "sampling_params": GREEDY}
        want = _generate(server.url, greedy)["output_ids"]
        deadline = time.monotonic() + 60
        while True:  # the router takes the worker back at a health check
            r = requests.post(pair.router + "/generate", json=greedy, timeout=60)
            if r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length":
                assert r.json()["output_ids"] == want
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(1)
        _wait_settled(servers[0], pair.decode)
        # and the decode server dies with requests in flight: the prefill server ends them
        # (a held one when its registration breaks, one not registered at its timeout)
        with ThreadPoolExecutor(4) as pool:
            outcomes = pool.map(send, range(4))
            time.sleep(0.5)
            pair.decode.proc.kill()
            assert all(isinstance(o, str) for o in outcomes)
        _wait_settled(servers[0], timeout=60)


def test_three_prefill_servers_one_decode_server(server, plain_pair, mtp_pair, tmp_path):
    """3P1D behind one router: both pairs' prefill servers (one with MTP: its MTP state is
    not sent to a decode server without MTP) and a third with --tp-size 2 (rank 0 holds the
    whole latent KV and sends it), all into the plain pair's decode server (--tp-size 1)."""
    tp_port, tp_boot = free_port(), free_port()
    tp_cmd = _prefill_cmd(tp_port, tp_boot, "--tp-size", "2")
    with _processes([(tp_cmd, f"http://127.0.0.1:{tp_port}")], tmp_path) as (tp, _):
        prefills = [
            (plain_pair.prefill, plain_pair.bootstrap_port),
            (mtp_pair.prefill, mtp_pair.bootstrap_port),
            (tp[0], tp_boot),
        ]
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for p, boot in prefills:
            cmd += ["--prefill", p.url, str(boot)]
        cmd += ["--decode", plain_pair.decode.url, "--policy", "round_robin"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
        sent = [p.metric("sglang:kv_transfer_bytes_total") for p, _ in prefills]
        with _processes([(cmd, None)], tmp_path / "router") as (_, procs):
            url = f"http://127.0.0.1:{port}"
            _wait_router(procs[0][0], url, procs[0][1])
            for prompt in PROMPTS + PROMPTS[:2]:
                body = {"text": prompt, "sampling_params": GREEDY}
                want = _generate(server.url, body)["output_ids"]
                assert _generate(url, body)["output_ids"] == want
        for (p, _), before in zip(prefills, sent):
            assert p.metric("sglang:kv_transfer_bytes_total") > before  # each took requests
        _wait_settled(*(p for p, _ in prefills), plain_pair.decode)
