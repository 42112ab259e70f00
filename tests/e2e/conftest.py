"""End-to-end fixtures: ONE real server subprocess per test session, on a free port.

The server runs `python -m srt_ascend.launch_server` on the shipped checkpoint (override with
SRT_TEST_MODEL) with one CPU thread; every e2e test talks to it over HTTP. SGLang's own
clients run in the interpreter named by SRT_SGLANG_PYTHON (default: `.venv-sglang/bin/python`
in the repository when it exists, else this interpreter); their tests fail when that
interpreter cannot import sglang (scripts/setup_test_env.sh installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from srt_ascend.server_args import SHIPPED_MODEL

REPO = Path(__file__).resolve().parents[2]
E2E_MODEL = os.environ.get("SRT_TEST_MODEL", SHIPPED_MODEL)
STARTUP_TIMEOUT_S = 180
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


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The shared server: default settings, float32, MTP off."""
    with running_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory) -> Server:
    """A second server with MTP speculative decoding (2 draft tokens per step)."""
    args = ("--speculative-algorithm", "MTP", "--speculative-num-steps", "2")
    with running_server(tmp_path_factory.mktemp("mtp_server"), *args) as s:
        yield s


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(E2E_MODEL, local_files_only=True)


def _sglang_python() -> str:
    env = os.environ.get("SRT_SGLANG_PYTHON")
    if env:
        return env
    venv = REPO / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """An interpreter that has sglang installed (scripts/setup_test_env.sh installs it), else
    the test fails: a missing client set is a set-up defect, not absent hardware."""
    python = _sglang_python()
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.fail(
            f"sglang is not importable by {python}: run scripts/setup_test_env.sh (the lean "
            f"sglang==0.5.23 client set) or point SRT_SGLANG_PYTHON at an interpreter that "
            f"has it\n{probe.stderr[-2000:]}"
        )
    return python


@pytest.fixture(scope="session")
def run_example(server):
    """run(python, script) runs python/<script> against the server and returns the JSON the
    example reports on its last stdout line."""

    def run(python: str, script: str, timeout: float = 300) -> dict:
        proc = subprocess.run(
            [python, str(REPO / "python" / script), "--url", server.url],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=timeout,
            cwd=REPO,
        )
        assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


# Runs several python/ examples in ONE interpreter (importing sglang takes ~10 s), each as
# __main__ with its own argv, and prints {script: the JSON the script reported}.
_RUN_MANY = """
import contextlib, io, json, runpy, sys
url, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, {examples!r})
results = {{}}
for script in scripts:
    buf = io.StringIO()
    sys.argv = [script, "--url", url]
    with contextlib.redirect_stdout(buf):
        runpy.run_path({examples!r} + "/" + script, run_name="__main__")
    results[script] = json.loads(buf.getvalue().strip().splitlines()[-1])
print(json.dumps(results))
"""


@pytest.fixture(scope="session")
def run_examples(server):
    """run(python, scripts) runs python/<script>s against the server in one interpreter and
    returns {script: reported JSON}."""

    def run(python: str, scripts: list[str], timeout: float = 600) -> dict:
        code = _RUN_MANY.format(examples=str(REPO / "python"))
        proc = subprocess.run(
            [python, "-c", code, server.url, *scripts],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=timeout,
            cwd=REPO,
        )
        assert proc.returncode == 0, f"{scripts} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def launch_cli():
    """launch(*args) runs `python -m srt_ascend.launch_server ARGS` to completion (for the
    CLI's error exits) and returns the CompletedProcess."""

    def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "srt_ascend.launch_server", *args],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=timeout,
            cwd=REPO,
        )

    return launch


@pytest.fixture(scope="session")
def subprocess_env() -> dict:
    return child_env()


@pytest.fixture(scope="session", name="free_port")
def free_port_fixture():
    """free_port() -> an unused local TCP port."""
    return free_port


@pytest.fixture(scope="session")
def e2e_model() -> str:
    return E2E_MODEL
