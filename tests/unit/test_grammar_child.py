"""The grammar compiler's child process ends quietly when its parent goes away at any point of
the pipe protocol (a server stopped mid-start or mid-compile must not print a traceback)."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from srt_ascend.constrained.compile_worker import JsonWhitespace
from srt_ascend.server_args import SHIPPED_MODEL


@pytest.fixture(scope="module")
def info_json() -> str:
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    return xgr.TokenizerInfo.from_huggingface(tok).serialize_json()


def _message(obj) -> bytes:
    """One multiprocessing.connection message: a 4-byte big-endian length, then the pickle."""
    body = pickle.dumps(obj)
    return struct.pack("!i", len(body)) + body


def _run_child(payload: bytes, read_answers: bool = True) -> subprocess.CompletedProcess:
    """Starts the real child, writes `payload` into its job pipe and closes it (the parent
    going away); returns the finished child with its stderr."""
    jobs_r, jobs_w = os.pipe()
    answers_r, answers_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "srt_ascend.constrained.compile_child", str(jobs_r), str(answers_w)],
        pass_fds=(jobs_r, answers_w),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    os.close(jobs_r)
    os.close(answers_w)
    if not read_answers:  # nobody reads: the child's answer meets a closed pipe
        os.close(answers_r)
    with os.fdopen(jobs_w, "wb") as w:
        w.write(payload)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        if read_answers:
            os.close(answers_r)
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, err)


def test_child_exits_quietly_when_cut_mid_start(info_json):
    whole = _message((info_json, JsonWhitespace()))
    done = _run_child(whole[: len(whole) // 2])  # killed while sending the tokenizer info
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


def test_child_exits_quietly_when_cut_mid_job(info_json):
    job = _message(("regex", "[a-z]+"))
    done = _run_child(_message((info_json, JsonWhitespace())) + job[:6])
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


def test_child_exits_quietly_when_its_answer_meets_a_closed_pipe(info_json):
    payload = _message((info_json, JsonWhitespace())) + _message(("regex", "[a-z]+"))
    done = _run_child(payload, read_answers=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""
