"""The prefill server's bootstrap endpoint (`--disaggregation-bootstrap-port`) and the decode
server's side of it.

`POST /disagg/kv` (decode -> prefill): a KVDestination. The prefill server's scheduler gets
it as a DestinationArrived message; the HTTP answer is held until that request's KV is
written (200, a KVResult) or failed (4xx/5xx, a KVResult with the error), so one long request
per room carries the whole exchange: a decode server that dies closes it (the prefill side
then cancels the room), a prefill server that dies breaks it (the decode side fails the
request). `POST /disagg/cancel` {"room": R}: the decode server gave up room R.
`GET /health`: 200.
"""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from srt_ascend.disaggregation.protocol import (
    DestinationArrived,
    KVDestination,
    KVResult,
    RoomCancelled,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often a held registration checks whether its decode server went away


class _Room:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: KVResult | None = None
        self.status = 200


class BootstrapServer:
    """Runs in its own threads; hands registrations to `submit` (the scheduler's inbox) and
    holds each one's HTTP answer until `answer(room, ...)`."""

    def __init__(self, host: str, port: int, submit: Callable[[object], None]) -> None:
        self.submit = submit
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the server's log is the scheduler's
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._send(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:  # noqa: N802
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                except ValueError:
                    self._send(400, {"ok": False, "error": "the body must be JSON"})
                    return
                if self.path == "/disagg/kv":
                    status, result = server._register(body, self.connection)
                    self._send(status, result.to_json())
                elif self.path == "/disagg/cancel" and isinstance(body, dict):
                    server.submit(RoomCancelled(int(body.get("room", -1))))
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"ok": False, "error": f"no route {self.path}"})

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the decode server went away
                    pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="disagg-bootstrap", daemon=True
        )
        self.thread.start()
        logger.info("bootstrap endpoint on %s:%d", host, port)

    def _register(self, body, conn: socket.socket) -> tuple[int, KVResult]:
        try:
            dest = KVDestination.from_json(body)
        except ValueError as e:
            return 400, KVResult(False, str(e))
        room = _Room()
        with self._lock:
            if dest.room in self._rooms:
                return 409, KVResult(False, f"bootstrap_room {dest.room} is already registered")
            self._rooms[dest.room] = room
        self.submit(DestinationArrived(dest))
        while not room.done.wait(POLL_S):
            if _peer_closed(conn):
                self.submit(RoomCancelled(dest.room))
                room.done.wait()
                break
        with self._lock:
            del self._rooms[dest.room]
        assert room.result is not None
        return room.status, room.result

    def answer(self, room: int, result: KVResult, status: int = 200) -> None:
        """Ends room `room`'s held registration with `result` (nothing if none is held)."""
        with self._lock:
            r = self._rooms.get(room)
        if r is not None and not r.done.is_set():
            r.result, r.status = result, status
            r.done.set()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _peer_closed(conn: socket.socket) -> bool:
    """Whether the client of a held request closed its connection (readable with no data:
    the request was read whole, so anything readable now is its end)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


# TCP keepalive on a held registration: a prefill host that vanishes (no RST) is noticed
# after about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S seconds
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive times
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def register_and_wait(
    host: str, port: int, dest: KVDestination, timeout: float, on_late: Callable[[], None]
) -> tuple[KVResult, bool]:
    """Decode side: registers `dest` at the prefill server's bootstrap endpoint and waits for
    its answer. Returns (result, answered): `answered` False when no answer came (the
    endpoint unreachable, the connection broken), so the prefill server may not know the
    room is given up.

    Without an answer in `timeout` seconds it calls `on_late()` and goes on waiting: until
    the prefill server answers (it answers only when nothing of the room is being written,
    nor will be) or the connection breaks (its process is gone, and its transfer engine with
    it; keepalive notices a host that vanished), the slots it may write are not free."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/disagg/kv",
            json.dumps(dest.to_json()),
            {"Content-Type": "application/json"},
        )
        _keepalive(conn.sock)
        if not select.select([conn.sock], [], [], timeout)[0]:
            on_late()
        conn.sock.settimeout(None)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        return KVResult.from_json(body), True
    except (OSError, http.client.HTTPException, ValueError, TypeError) as e:
        message = f"no answer from the prefill server's bootstrap endpoint {host}:{port}: {e}"
        return KVResult(False, message), False
    finally:
        conn.close()


def cancel_room(host: str, port: int, room: int, timeout: float = 5.0) -> None:
    """Decode side: tells the prefill server that room `room` is given up (best effort)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/disagg/cancel", json.dumps({"room": room}))
        conn.getresponse().read()
    except (OSError, http.client.HTTPException) as e:
        logger.warning("could not cancel room %d at %s:%d: %s", room, host, port, e)
    finally:
        conn.close()
