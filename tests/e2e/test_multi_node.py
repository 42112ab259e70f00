"""Two "nodes" on this machine (--nnodes 2, --tp-size 2, one rank each, gloo): a rank of node
1 that dies, or stops answering, ends both nodes, node 0 (the HTTP server) with exit code 1
and an error line, instead of node 0 waiting in a collective for a peer that is gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import requests
from e2e_servers import E2E_MODEL, REPO, _wait_healthy, child_env, free_port

DIST_TIMEOUT_S = 30  # the frozen rank's collective raises after this (the start, under a
# loaded suite, must fit in it too: 15 s failed once at load 4)
END_WITHIN_S = DIST_TIMEOUT_S + 15


def _node(rank: int, addr: str, port: int, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "srt_ascend.launch_server", "--model-path", E2E_MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]
    cmd += ["--max-total-tokens", "4096", "--dtype", "float32", "--tp-size", "2"]
    cmd += ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]
    cmd += ["--dist-timeout", str(DIST_TIMEOUT_S)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO
        )


def _ended(proc: subprocess.Popen, log_path) -> int:
    try:
        return proc.wait(timeout=END_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {END_WITHIN_S} s after the fault:\n{log_path.read_text()}")


@pytest.fixture
def two_nodes(tmp_path):
    """(node processes, their log paths, node 0's URL, node 1's rank pid), both serving."""
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_node(0, addr, port, logs[0]), _node(1, addr, port, logs[1])]
    rank_pid = None
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(nodes[0], url, logs[0])
        body = {"text": "def f(x):", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200
        found = re.search(r"started tensor-parallel rank 1 \(pid (\d+)\)", logs[1].read_text())
        rank_pid = int(found[1])
        yield nodes, logs, url, rank_pid
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
        if rank_pid is not None:
            try:  # a stopped rank outlives its node's os._exit
                os.kill(rank_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_rank_dying_on_node_1_ends_every_node(two_nodes):
    nodes, logs, _url, rank_pid = two_nodes
    os.kill(rank_pid, signal.SIGKILL)
    assert [_ended(p, log) for p, log in zip(nodes, logs)] == [1, 1]
    assert "tensor-parallel rank 1" in logs[1].read_text()
    assert " ERROR " in logs[0].read_text()


def test_a_rank_that_stops_answering_ends_every_node(two_nodes):
    """The rank is frozen (SIGSTOP): its sockets stay open, so only --dist-timeout ends node
    0's collective; node 1 then finds node 0 gone and ends too."""
    nodes, logs, url, rank_pid = two_nodes
    os.kill(rank_pid, signal.SIGSTOP)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4}}

    def request() -> None:
        try:
            requests.post(url + "/generate", json=body, timeout=END_WITHIN_S)
        except requests.RequestException:
            pass  # the server ends under it

    threading.Thread(target=request, daemon=True).start()
    assert [_ended(p, log) for p, log in zip(nodes, logs)] == [1, 1]
    assert "the scheduler stopped" in logs[0].read_text()
    assert "node 0 is gone" in logs[1].read_text()
