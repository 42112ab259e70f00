"""Security of a real server: no route returns a secret (every route, GET and POST, with no
key, the API key and the admin key; with both keys set and with the admin key alone), a
`cache_salt` keeps n > 1's shared prefill out of other tenants' cache, a slow request body is
disconnected within --request-read-timeout, and a flood of /health_generate probes runs a
bounded number of generations."""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid

import pytest
import requests
from e2e_servers import running_server

from srt_ascend.entrypoints.http_server import create_app
from srt_ascend.server_args import REDACTED, ServerArgs

KEY, ADMIN = "user-key-5b1e", "admin-key-9c7f"
READ_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    args = ("--api-key", KEY, "--admin-api-key", ADMIN)
    args += ("--request-read-timeout", str(READ_TIMEOUT_S))
    with running_server(tmp_path_factory.mktemp("keyed"), *args) as s:
        yield s


@pytest.fixture(scope="module")
def admin_only_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("admin_only"), "--admin-api-key", ADMIN) as s:
        yield s


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route registered on the app (every method but HEAD), path
    parameters filled in. The app is built without a runtime: routes are registered at
    creation."""
    app = create_app(None, ServerArgs())
    found, todo = [], list(app.routes)
    while todo:
        route = todo.pop()
        if hasattr(route, "original_router"):  # an included APIRouter
            todo += route.original_router.routes
            continue
        path = re.sub(r"\{[^}]+\}", "tiny-mtp", route.path)
        for method in sorted(set(getattr(route, "methods", ())) - {"HEAD"}):
            found.append((method, path))
    return sorted(found)


# Who may call each route: OPEN without a key, ADMIN_OP with the admin key when one is set (else
# as USER), USER with the API key when one is set. /abort_request is two operations: by rid a
# user's, abort_all an admin's. Every route must be listed here, so a new route (and a new
# admin operation) is classified before it ships.
OPEN, USER, ADMIN_OP = "open", "user", "admin"
ROUTE_LEVELS = {
    ("GET", "/health"): OPEN,
    ("GET", "/health_generate"): OPEN,
    ("GET", "/metrics"): OPEN,
    ("POST", "/flush_cache"): ADMIN_OP,
    ("GET", "/ready"): OPEN,  # as SGLang's auth: a readiness probe carries no key
    ("GET", "/docs"): USER,
    ("GET", "/docs/oauth2-redirect"): USER,
    ("GET", "/redoc"): USER,
    ("GET", "/openapi.json"): USER,
    ("GET", "/get_model_info"): USER,
    ("GET", "/model_info"): USER,
    ("GET", "/get_server_info"): USER,
    ("GET", "/server_info"): USER,
    ("POST", "/generate"): USER,
    ("PUT", "/generate"): USER,
    ("POST", "/tokenize"): USER,
    ("POST", "/detokenize"): USER,
    ("GET", "/v1/models"): USER,
    ("GET", "/v1/models/tiny-mtp"): USER,
    ("POST", "/v1/completions"): USER,
    ("POST", "/v1/chat/completions"): USER,
    ("POST", "/v1/responses"): USER,
    ("GET", "/v1/responses/tiny-mtp"): USER,
    ("POST", "/v1/score"): USER,
    ("POST", "/v1/tokenize"): USER,
    ("POST", "/v1/detokenize"): USER,
}
ABORT_OPERATIONS = {
    "by rid": ({"rid": "no-such-request"}, USER),
    "all": ({"abort_all": True}, ADMIN_OP),
}


def _calls() -> list[tuple[str, str, str, dict | None, str]]:
    """(method, path, operation, body, level) of every route (/abort_request: each of its
    operations)."""
    calls = []
    for method, path in _routes():
        if path == "/abort_request":
            for op, (body, level) in ABORT_OPERATIONS.items():
                calls.append((method, path, op, body, level))
        else:
            body = {} if method in ("POST", "PUT") else None
            calls.append((method, path, "", body, ROUTE_LEVELS[(method, path)]))
    return calls


_WALKS: dict[str, list[tuple[tuple, str | None, requests.Response]]] = {}


def _walk(server) -> list[tuple[tuple, str | None, requests.Response]]:
    """Every call of `_calls` with no key, the API key and the admin key: (call, key,
    response), once per server."""
    if server.url not in _WALKS:
        answers = []
        for call in _calls():
            method, path, _, body, _ = call
            for key in (None, KEY, ADMIN):
                r = requests.request(
                    method, server.url + path, headers=_auth(key), json=body, timeout=60
                )
                answers.append((call, key, r))
        _WALKS[server.url] = answers
    return _WALKS[server.url]


def test_the_route_walk_sees_every_kind_of_route():
    routes = _routes()
    for expected in (
        ("GET", "/server_info"),
        ("GET", "/get_server_info"),
        ("POST", "/generate"),
        ("POST", "/flush_cache"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/tiny-mtp"),
        ("GET", "/openapi.json"),
    ):
        assert expected in routes
    # every route is classified (a new one fails here until it is given its level)
    assert set(routes) - {("POST", "/abort_request")} == set(ROUTE_LEVELS)


def _allowed_keys(level: str, path: str, which: str) -> set[str | None]:
    """The keys a call of `level` is let through with, on a server with both keys or with the
    admin key alone."""
    every = {None, KEY, ADMIN}
    if level == OPEN:
        return every
    if level == ADMIN_OP:
        return {ADMIN}
    if which == "admin_key_only":
        return every  # no API key: user operations are open
    return {KEY, ADMIN} if path == "/abort_request" else {KEY}


@pytest.mark.parametrize("which", ["both_keys", "admin_key_only"])
def test_every_route_answers_401_exactly_without_its_key(which, request):
    """Each route x operation x key kind: 401 where the key does not open it (abort_all
    without the admin key included), never 401 where it does."""
    fixture = "keyed_server" if which == "both_keys" else "admin_only_server"
    wrong = []
    for (method, path, op, _, level), key, r in _walk(request.getfixturevalue(fixture)):
        allowed = key in _allowed_keys(level, path, which)
        if (r.status_code == 401) == allowed:
            wrong.append(f"{method} {path} {op} key={key}: {r.status_code} {r.text[:80]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("which", ["both_keys", "admin_key_only"])
def test_no_route_returns_a_secret(which, request):
    fixture = "keyed_server" if which == "both_keys" else "admin_only_server"
    server = request.getfixturevalue(fixture)
    secrets = [ADMIN] if which == "admin_key_only" else [KEY, ADMIN]
    answered = 0
    for (method, path, _, _, _), key, r in _walk(server):
        seen = r.text + repr(dict(r.headers))
        for secret in secrets:
            assert secret not in seen, f"{method} {path} (key {key}) returned a secret"
        answered += r.status_code == 200
    assert answered > 10  # the walk got past the key check on many routes
    info_key = KEY if which == "both_keys" else None
    info = server.get("/server_info", headers=_auth(info_key)).json()
    assert info["admin_api_key"] == REDACTED
    assert info["api_key"] == (REDACTED if which == "both_keys" else None)


def test_a_keyless_abort_all_leaves_other_clients_requests_running(admin_only_server):
    """The issue's reproduction: with only --admin-api-key set, a keyless abort_all is refused
    and another client's generation runs to its length; the admin key aborts it."""
    s = admin_only_server
    body = {"text": "def f(", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    done: list[requests.Response] = []
    thread = threading.Thread(target=lambda: done.append(s.post("/generate", json=body)))
    thread.start()
    while s.get("/server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
        time.sleep(0.05)
    r = s.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
    thread.join(timeout=120)
    meta = done[0].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400
    thread = threading.Thread(target=lambda: done.append(s.post("/generate", json=body)))
    thread.start()
    while s.get("/server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
        time.sleep(0.05)
    assert s.post("/abort_request", json={"abort_all": True}, headers=_auth(ADMIN)).ok
    thread.join(timeout=120)
    assert done[1].json()["meta_info"]["finish_reason"]["type"] == "abort"


def _long_prompt() -> str:
    """About 270 tokens no earlier request has sent."""
    tag = uuid.uuid4().hex
    return " ".join(f"w{tag[i % 32]}{i}" for i in range(90))


def test_cache_salt_keeps_n_samples_prefill_out_of_the_unsalted_tree(keyed_server):
    s, prompt = keyed_server, _long_prompt()
    body = {
        "text": prompt,
        "sampling_params": {"n": 2, "max_new_tokens": 2},
        "cache_salt": "tenant-a",
    }
    r = s.post("/generate", json=body, headers=_auth(KEY))
    assert r.status_code == 200, r.text
    samples = [o["meta_info"] for o in r.json()]
    prompt_tokens = samples[0]["prompt_tokens"]
    assert prompt_tokens > 200
    # The samples found the salted prefill (the prompt was computed once, not n + 1 times).
    assert all(m["cached_tokens"] >= prompt_tokens - 1 for m in samples), samples
    # Another tenant (no salt) sees nothing of it.
    plain = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    r = s.post("/generate", json=plain, headers=_auth(KEY))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["cached_tokens"] == 0


def _open_seconds(url: str, first: bytes, limit: float) -> float | None:
    """Sends `first` then one body byte every 0.2 s; the seconds until the server closed the
    connection, None if still open after `limit`."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=0.2) as sock:
        sock.sendall(first)
        while time.monotonic() - start < limit:
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                pass
            except ConnectionError:
                return time.monotonic() - start
            try:
                sock.sendall(b" ")
            except ConnectionError:
                return time.monotonic() - start
    return None


def test_a_slow_request_body_is_disconnected(keyed_server):
    s = keyed_server
    head = (
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 100000\r\n\r\n" + '{"text": "'
    )
    open_for = _open_seconds(s.url, head.encode(), limit=READ_TIMEOUT_S + 10)
    assert open_for is not None, "a client dripping its body kept the connection"
    assert READ_TIMEOUT_S - 0.5 <= open_for < READ_TIMEOUT_S + 3, open_for
    # The server serves on, and an answer slower than the read timeout is not cut.
    body = {"text": "def f(", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    start = time.monotonic()
    r = s.post("/generate", json=body, headers=_auth(KEY))
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 64
    assert "--request-read-timeout" in s.log()
    print(
        f"slow body closed after {open_for:.1f} s; a 64-token answer took "
        f"{time.monotonic() - start:.1f} s"
    )


def _prefilled_seqs(log: str) -> int:
    return sum(int(n) for n in re.findall(r"Prefill batch\. #new-seq: (\d+)", log))


def test_a_health_generate_flood_runs_few_generations(keyed_server):
    """64 keyless clients probing as fast as they can for 3 s: every probe answers 200 and
    the runtime prefills at most one probe per second (the answer's reuse time) plus one.
    Before the bound each probe was a generation (thousands)."""
    s = keyed_server
    while True:  # idle (earlier tests' requests done)
        state = s.get("/server_info", headers=_auth(KEY)).json()["internal_states"][0]
        if state["num_running_reqs"] == state["num_queue_reqs"] == 0:
            break
        time.sleep(0.1)
    before = len(s.log())
    stop = time.monotonic() + 3.0
    codes: list[int] = []

    def client() -> None:
        with requests.Session() as session:
            while time.monotonic() < stop:
                codes.append(session.get(s.url + "/health_generate", timeout=60).status_code)

    threads = [threading.Thread(target=client) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - (stop - 3.0)
    time.sleep(0.5)  # the last prefill's log line
    generations = _prefilled_seqs(s.log()[before:])
    assert codes and set(codes) == {200}, set(codes)
    assert len(codes) > 64
    assert 1 <= generations <= elapsed / 1.0 + 2, (generations, len(codes))


def test_a_rid_reused_right_after_a_disconnect_gets_its_own_answer(keyed_server):
    """The issue's reproduction over HTTP, bounded to seconds: a streaming request's client
    leaves after its first token and a new request with the same rid follows at once
    (retried while the server still reports the rid in use). The new request must answer
    its own prompt, never end with the abandoned request's abort. The deterministic form of
    this race is tests/engine/test_request_identity.py."""
    s = keyed_server
    old = {"text": "def f(x):\n" * 20, "stream": True}
    new = {"text": "import os\n", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for i in range(10):
        rid = f"reuse-{uuid.uuid4().hex}"
        body = {**old, "rid": rid, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        with requests.post(
            s.url + "/generate", json=body, headers=_auth(KEY), stream=True, timeout=60
        ) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith(b"data: {"))
        deadline = time.monotonic() + 10
        while True:  # the server notices the disconnect at its next token
            r = s.post("/generate", json={**new, "rid": rid}, headers=_auth(KEY))
            if r.status_code != 400 or "duplicate" not in r.text:
                break
            assert time.monotonic() < deadline, r.text
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length", (i, meta)
        assert meta["completion_tokens"] == 2 and meta["id"] == rid
