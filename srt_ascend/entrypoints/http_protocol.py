"""The HTTP/1.1 connection protocol the server runs: uvicorn's h11 protocol with a deadline on
reading each request, so a client that sends its headers or body slowly (slow loris) cannot
hold a connection forever.

    config = uvicorn.Config(app, http=bounded_read_protocol(30.0), ...)

uvicorn bounds only the idle time between two requests of a connection (`timeout_keep_alive`)
and h11 has no read timeout: a client that opens a connection and sends nothing, or sends a
request's headers and then one body byte now and then, keeps its connection (and the route
waiting on the body) as long as it likes. Here the whole request (headers and body) must arrive
within `timeout` seconds of the connection opening or of the request's first byte; else the
connection is closed (the route reading the body sees the client gone). Once a request is
read, its answer may take as long as it takes (a long generation or stream is not cut).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# The client's h11 states in which it has not finished sending the current request.
_READING = (h11.IDLE, h11.SEND_BODY)


class BoundedReadH11Protocol(H11Protocol):
    """H11Protocol plus a per-request read deadline (`read_timeout` seconds, set by
    `bounded_read_protocol`). The deadline is armed when the connection opens and at the first
    bytes of each later request, and disarmed once the request's last byte is in; when it
    fires the transport is closed."""

    read_timeout: float = 30.0
    _read_deadline: asyncio.TimerHandle | None = None  # armed while a request is being read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _READING:
            if self._read_deadline is None:  # the first bytes of a new request
                self._arm_read_deadline()
        else:  # the request is in (or the connection is closing)
            self._disarm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        """Between requests uvicorn's keep-alive timeout bounds the idle time; the deadline
        stays armed only while the answered request's body is still unread."""
        if self.conn.their_state != h11.SEND_BODY:
            self._disarm_read_deadline()
        super().on_response_complete()

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        logger.warning(
            "closing the connection from %s: its request was not received within %.0f s "
            "(--request-read-timeout)",
            self.client,
            self.read_timeout,
        )
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        self.transport.close()


def bounded_read_protocol(timeout: float) -> type[BoundedReadH11Protocol]:
    """The protocol class for uvicorn's `http=` with a `timeout`-second request read
    deadline (uvicorn instantiates it per connection)."""
    return type("BoundedReadH11Protocol", (BoundedReadH11Protocol,), {"read_timeout": timeout})
