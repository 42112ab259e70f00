"""End-to-end fixtures: ONE real server subprocess per test session, on a free port.

The server runs `python -m srt_ascend.launch_server` on the shipped checkpoint (override with
SRT_TEST_MODEL) with one CPU thread; every e2e test talks to it over HTTP. SGLang's own
clients run in the interpreter named by SRT_SGLANG_PYTHON (default: `.venv-sglang/bin/python`
in the repository when it exists, else this interpreter); their tests fail when that
interpreter cannot import sglang (scripts/setup_test_env.sh installs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from disagg_pairs import MTP, Pair, _pairs
from e2e_servers import (  # noqa: F401 - re-exported for the fixtures below
    E2E_MODEL,
    READY_MESSAGE,
    REPO,
    STARTUP_TIMEOUT_S,
    Server,
    _wait_healthy,
    child_env,
    free_port,
    running_server,
    serving_process,
)


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


# ---- prefill-decode pairs (test_disaggregation*.py: each module starts its own) ------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Pair]:
    """MTP off on both servers; MTP K=2 on both, the decode server verifying with fia (one
    row of 1+K queries; the colocated server's MTP default is expand, and a prefill server
    never verifies)."""
    specs = [((), ()), (MTP, ("--speculative-verify", "fia"))]
    with _pairs(tmp_path_factory.mktemp("pd"), specs) as (plain, mtp):
        yield {"plain": plain, "mtp": mtp}


@pytest.fixture(scope="module")
def plain_pair(pairs) -> Pair:
    return pairs["plain"]


@pytest.fixture(scope="module")
def mtp_pair(pairs) -> Pair:
    return pairs["mtp"]


@pytest.fixture(params=["plain", "mtp"])
def pair(request) -> Pair:
    return request.getfixturevalue(f"{request.param}_pair")
