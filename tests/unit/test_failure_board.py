"""The failure board: a failure posted by one node (its rank died) reaches every node's
watcher within a poll or two and ends that node with the posted line; node 0's stop notice
makes the others take the store's going away as the stop."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from srt_ascend.distributed import DistInit
from srt_ascend.distributed.failure_board import FAILED_KEY, FailureBoard
from srt_ascend.managers.tp_ranks import RankProcesses
from srt_ascend.server_args import ServerArgs


@pytest.fixture
def store_addr():
    """A rendezvous store as rank 0 serves one (the TCPStore master)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    yield f"127.0.0.1:{port}"
    del master


def _wait(items: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not items and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_failure_posted_by_another_node_ends_node_0(store_addr):
    failures: list[str] = []
    # Node 0 of two, one rank per node: no local rank process, only the watcher.
    ranks = RankProcesses(ServerArgs(), DistInit(store_addr, 2, 2, 0), failures.append)
    assert ranks.procs == []
    time.sleep(1.0)
    assert failures == []  # nothing posted: nothing ends
    line = "tensor-parallel rank 1 (pid 7) exited with code -9 on node 1; ..."
    FailureBoard(DistInit(store_addr, 2, 2, 1)).post(FAILED_KEY, line)
    _wait(failures, 5.0)
    ranks._watcher.join(timeout=5.0)  # it ends once it has reported
    assert failures == [line] and not ranks._watcher.is_alive()


def test_node_0_stopping_is_not_a_failure(store_addr):
    failures: list[str] = []
    ranks = RankProcesses(ServerArgs(), DistInit(store_addr, 2, 2, 0), failures.append)
    ranks.announce_stop()
    ranks._watcher.join(timeout=5.0)
    assert not ranks._watcher.is_alive() and failures == []
    _message, stopping = FailureBoard(DistInit(store_addr, 2, 2, 1)).read()
    assert stopping  # the other nodes learn it from the board
