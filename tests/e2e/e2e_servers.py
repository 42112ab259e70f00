"""The e2e tests' server helpers (a module of its own: test modules import it by a name no
other test directory uses, where `from conftest import` could find another directory's)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from srt_ascend.server_args import SHIPPED_MODEL

REPO = Path(__file__).resolve().parents[2]
E2E_MODEL = os.environ.get("SRT_TEST_MODEL", SHIPPED_MODEL)
STARTUP_TIMEOUT_S = 180
# Greedy prompts the router tests compare across server layouts (code, prose, a repeat).
ROUTED_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
READY_MESSAGE = "The server is fired up and ready to roll!"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """The environment for subprocesses: one intra-op thread, the repo importable, no hub
    look-ups (nothing outside this machine is reachable)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Server:
    url: str
    model_path: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, timeout=60, **kw)

    def internal_state(self) -> dict:
        return self.get("/server_info").json()["internal_states"][0]

    def metric(self, name: str) -> float:
        """The value of one unlabelled-but-model_name sample in /metrics."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.internal_state()
            if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {state}")
            time.sleep(0.1)


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}")


@contextlib.contextmanager
def serving_process(cmd: list[str], url: str, log_path: Path):
    """Runs `cmd` (a server listening at `url`), yields its Server handle once /health
    answers, and stops it afterwards."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO
        )
    try:
        _wait_healthy(proc, url, log_path)
        yield Server(url, E2E_MODEL, proc, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(log_dir: Path, *extra_args: str):
    """Launches one srt_ascend server subprocess and yields its Server handle."""
    port = free_port()
    cmd = [sys.executable, "-m", "srt_ascend.launch_server", "--model-path", E2E_MODEL]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]
    cmd += ["--max-total-tokens", "32768", "--served-model-name", "tiny-mtp"]
    cmd += ["--dtype", "float32", *extra_args]
    with serving_process(cmd, f"http://127.0.0.1:{port}", log_dir / "server.log") as server:
        yield server
