"""Server hardening without a model: secrets redacted from the server info, the bounded
/health_generate probe, the request read deadline (slow loris) on a real uvicorn server, and
the data-parallel routing of a prompt's samples with its prefill."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from srt_ascend.entrypoints.health import HealthProbe
from srt_ascend.entrypoints.http_protocol import bounded_read_protocol
from srt_ascend.managers.dp_scheduler import GroupRouter
from srt_ascend.managers.tokenizer_manager import ServerBusyError
from srt_ascend.server_args import REDACTED, SECRET_FIELDS, ServerArgs

# ---- secrets --------------------------------------------------------------------------------


def test_redacted_masks_every_set_secret_and_keeps_unset_ones_none():
    args = ServerArgs(api_key="user-secret", admin_api_key="admin-secret")
    info = args.redacted()
    assert set(SECRET_FIELDS) == {"api_key", "admin_api_key"}
    assert info["api_key"] == info["admin_api_key"] == REDACTED
    assert "secret" not in repr(info)
    assert info["port"] == args.port  # the rest is untouched
    admin_only = ServerArgs(admin_api_key="admin-secret").redacted()
    assert admin_only["api_key"] is None and admin_only["admin_api_key"] == REDACTED


# ---- /health_generate's probe ---------------------------------------------------------------


class FakeRuntime:
    """admit/generate for HealthProbe: counts generations, each takes `delay` seconds."""

    def __init__(self, delay: float = 0.05, busy: bool = False) -> None:
        self.delay, self.busy = delay, busy
        self.generations = 0
        self.admitted = 0

    def admit(self) -> None:
        if self.busy:
            raise ServerBusyError("the request queue is full")
        self.admitted += 1

    async def generate(self) -> None:
        self.generations += 1
        await asyncio.sleep(self.delay)


def test_health_probe_runs_one_generation_for_a_flood():
    rt = FakeRuntime()
    probe = HealthProbe(rt.admit, rt.generate, ttl=0.5)

    async def flood() -> list[bool]:
        return await asyncio.gather(*(probe.check() for _ in range(500)))

    assert all(asyncio.run(flood()))
    assert rt.generations == 1 and rt.admitted == 1


def test_health_probe_reuses_an_answer_for_ttl_then_probes_again():
    rt = FakeRuntime(delay=0.0)
    probe = HealthProbe(rt.admit, rt.generate, ttl=0.3)

    async def run() -> None:
        assert await probe.check()
        for _ in range(50):
            assert await probe.check()
        assert rt.generations == 1
        await asyncio.sleep(0.35)
        assert await probe.check()
        assert rt.generations == 2

    asyncio.run(run())


def test_health_probe_is_admitted_like_a_request():
    rt = FakeRuntime(busy=True)
    probe = HealthProbe(rt.admit, rt.generate)
    with pytest.raises(ServerBusyError):
        asyncio.run(probe.check())
    assert rt.generations == 0


def test_health_probe_timeout_is_unhealthy_and_a_leaving_caller_does_not_cancel_it():
    rt = FakeRuntime(delay=0.2)
    probe = HealthProbe(rt.admit, rt.generate, ttl=10.0, timeout=0.1)

    async def run() -> None:
        first = asyncio.ensure_future(probe.check())
        await asyncio.sleep(0.01)
        first.cancel()  # the client that started the probe leaves
        assert await probe.check() is False  # the shared probe still ran to its timeout
        assert rt.generations == 1

    asyncio.run(run())


def test_a_cancelled_probe_does_not_wedge_later_checks():
    """The probe's generation is cancelled (the server stopping): the callers see the
    cancellation, and the next check runs a new probe instead of waiting on the dead one."""
    rt = FakeRuntime(delay=0.0)
    real = rt.generate

    async def cancelled_once() -> None:
        rt.generate = real
        rt.generations += 1
        raise asyncio.CancelledError

    rt.generate = cancelled_once
    probe = HealthProbe(rt.admit, lambda: rt.generate(), ttl=0.0)

    async def run() -> None:
        with pytest.raises(asyncio.CancelledError):
            await probe.check()
        assert await probe.check() is True
        assert rt.generations == 2

    asyncio.run(run())


# ---- request read deadline (slow loris) -----------------------------------------------------


async def _echo_app(scope, receive, send) -> None:
    """Reads the whole body, then answers its length after `slow` seconds (query ?slow=S)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    query = scope["query_string"].decode()
    if query.startswith("slow="):
        await asyncio.sleep(float(query[5:]))
    answer = str(len(body)).encode()
    headers = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@contextlib.contextmanager
def _server(read_timeout: float | None):
    """A uvicorn server on a free port in a thread: the bounded protocol, or uvicorn's
    own h11 protocol when `read_timeout` is None (the control)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = "h11" if read_timeout is None else bounded_read_protocol(read_timeout)
    config = uvicorn.Config(
        _echo_app, host="127.0.0.1", port=port, http=http, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _closed_within(port: int, first: bytes, drip: bytes, seconds: float) -> float | None:
    """Sends `first`, then `drip` every 0.2 s; the seconds until the server closed the
    connection, or None if it was still open after `seconds`."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
        if first:
            sock.sendall(first)
        while time.monotonic() - start < seconds:
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                pass
            except ConnectionError:
                return time.monotonic() - start
            try:
                if drip:
                    sock.sendall(drip)
            except ConnectionError:
                return time.monotonic() - start
    return None


HEADERS = (
    b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)


@pytest.mark.parametrize(
    "first, drip",
    [
        (HEADERS, b" "),  # headers, then the body one byte at a time
        (b"POST /x HTTP/1.1\r\nHost: t\r\n", b"X-A: b\r\n"),  # headers never end
        (b"", b""),  # connects and sends nothing
    ],
    ids=["slow-body", "slow-headers", "silent"],
)
def test_a_slow_request_is_disconnected_within_the_read_timeout(first, drip):
    with _server(read_timeout=1.0) as port:
        closed = _closed_within(port, first, drip, seconds=6.0)
    assert closed is not None and 0.9 <= closed < 3.0, closed


def test_control_uvicorn_alone_keeps_a_slow_body_open():
    """Without the deadline the same dripping client is still connected after 4 s."""
    with _server(read_timeout=None) as port:
        assert _closed_within(port, HEADERS, b" ", seconds=4.0) is None


def _read_answer(sock: socket.socket) -> bytes:
    """One answer of _echo_app (a one-digit body) read whole."""
    data = b""
    while b"\r\n\r\n" not in data or data.endswith(b"\r\n\r\n"):
        chunk = sock.recv(4096)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return data


def test_a_slow_answer_and_keep_alive_requests_are_not_cut():
    """The deadline bounds reading a request, not answering it: an answer taking 2 s (twice
    the deadline) arrives, and a second request on the same connection is served."""
    with _server(read_timeout=1.0) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /x?slow=2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
            first = _read_answer(sock)
            assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"3"), first
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nab")
            second = _read_answer(sock)
            assert second.startswith(b"HTTP/1.1 200") and second.endswith(b"2"), second


# ---- data-parallel routing ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue"])
def test_a_prompts_samples_go_to_its_prefills_group(method):
    router = GroupRouter(dp_size=2, method=method)
    loads = [0, 0]
    for prompt in range(6):
        key = f"prompt-{prompt}"
        prefill = router.group_of(key, loads)
        samples = [router.group_of(key, loads) for _ in range(3)]
        assert samples == [prefill] * 3
        router.group_of(None, loads)  # an unrelated request between two prompts
    assert sorted(loads) != [0, sum(loads)]  # both groups got work


def test_router_balances_unkeyed_requests_and_forgets_old_keys():
    router = GroupRouter(dp_size=2, method="round_robin")
    loads = [0, 0]
    assert [router.group_of(None, loads) for _ in range(4)] == [0, 1, 0, 1]
    assert loads == [2, 2]
    for keep, expected in ((2, 0), (1, 1)):  # keep=1: "a" is forgotten once "b" comes
        router = GroupRouter(dp_size=2, method="shortest_queue", keep=keep)
        assert router.group_of("a", [0, 0]) == 0
        assert router.group_of("b", [5, 0]) == 1
        assert router.group_of("a", [5, 0]) == expected
