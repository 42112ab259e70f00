"""A signal ends the server even when its event loop is stuck (busy with a huge body, or
waiting on a wedged scheduler): the signal handler arms a watchdog that ends the process
with one error line once the drain's time and a slack have passed."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn

import srt_ascend.launch_server as launch


def _server(monkeypatch, timeout: float):
    exits: list[str] = []
    monkeypatch.setattr(launch, "hard_exit", exits.append)
    monkeypatch.setattr(launch, "ABORT_GRACE_S", 0.2)
    monkeypatch.setattr(launch, "SHUTDOWN_SLACK_S", 0.3)
    server = launch.draining_server(uvicorn.Config(app=None), None, timeout)
    server.loop = asyncio.new_event_loop()  # never run: the loop is stuck
    return server, exits


def _wait_for(exits: list, seconds: float) -> float:
    start = time.monotonic()
    while not exits and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_signal_ends_the_process_when_the_event_loop_is_stuck(monkeypatch):
    server, exits = _server(monkeypatch, timeout=0.5)
    server.handle_exit(signal.SIGTERM, None)
    waited = _wait_for(exits, 5.0)
    assert exits and "did not stop within 1 s of the signal" in exits[0], exits
    assert waited >= 0.9  # not before the drain's time (0.5 + 0.2) and the slack (0.3)


def test_a_second_signal_shortens_the_wait(monkeypatch):
    server, exits = _server(monkeypatch, timeout=30.0)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)  # skips --shutdown-timeout
    _wait_for(exits, 5.0)
    assert exits, "the second signal's watchdog did not fire"


def test_an_armed_watchdog_keeps_the_exit_it_was_armed_with(monkeypatch):
    """A watchdog armed in a test ends with the test's stand-in even after the test (a
    watchdog reading the module's exit at fire time ended the whole pytest run once)."""
    exits: list[str] = []
    monkeypatch.setattr(launch, "hard_exit", exits.append)
    launch.exit_unless_stopped_within(0.3)
    monkeypatch.setattr(launch, "hard_exit", lambda msg: exits.append("the later exit"))
    _wait_for(exits, 5.0)
    assert exits and "did not stop within" in exits[0], exits
