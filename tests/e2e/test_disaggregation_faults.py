"""Prefill-decode disaggregation when things go wrong (pairs as in test_disaggregation.py,
disagg_pairs.py): bad bootstrap fields get HTTP 400; a client that leaves mid-stream, a
mismatched registration and abort storms (the router's own timeouts included) leave nothing
held on either server (both run --kv-invariant-check fatal, so a broken invariant would end a
server); a hung decode-side engine and a hung prefill server are each a scenario of their own.
A third pair (MTP, the decode server on two ranks verifying by expansion) is the one whose
servers die; a decode server fed by three prefill servers serves them all."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from disagg_pairs import (
    GREEDY,
    MTP,
    PROMPTS,
    _assert_matches_colocated,
    _generate,
    _pairs,
    _prefill_cmd,
    _prefills,
    _processes,
    _wait_router,
    _wait_settled,
)
from e2e_servers import free_port


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
