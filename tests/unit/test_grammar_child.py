"""The grammar compiler's child process ends quietly when its parent goes away at any point of
the pipe protocol (a server stopped mid-start or mid-compile must not print a traceback)."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import time

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from srt_ascend.constrained import compile_worker
from srt_ascend.constrained.compile_worker import CompileLane, GrammarError, JsonWhitespace
from srt_ascend.constrained.compilers import XGrammarCompiler, XGrammarSetup
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
    whole = _message((XGrammarSetup(info_json), JsonWhitespace()))
    done = _run_child(whole[: len(whole) // 2])  # killed while sending the tokenizer info
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


def test_child_exits_quietly_when_cut_mid_job(info_json):
    job = _message(("regex", "[a-z]+"))
    done = _run_child(_message((XGrammarSetup(info_json), JsonWhitespace())) + job[:6])
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


def test_child_exits_quietly_when_its_answer_meets_a_closed_pipe(info_json):
    payload = _message((XGrammarSetup(info_json), JsonWhitespace())) + _message(("regex", "[a-z]+"))
    done = _run_child(payload, read_answers=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""


def _lane(info_json: str) -> CompileLane:
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    return CompileLane(XGrammarCompiler(info), JsonWhitespace(), 60, "t")


def test_lane_says_started_once_its_child_has_imported(info_json):
    """`start` then `wait_started`: the child is running, has imported xgrammar (its native
    library is mapped) and said so; a job then compiles on that same child."""
    lane = _lane(info_json)
    try:
        assert not lane.started
        lane.start()
        assert lane.wait_started(120)
        assert lane.started
        pid = lane._child[0].pid
        with open(f"/proc/{pid}/maps") as f:
            assert "xgrammar" in f.read()
        assert lane.submit("regex", "[a-z]+").result(120) is not None
        assert lane._child[0].pid == pid
    finally:
        lane.close()
    assert not lane.started


def test_a_child_started_ahead_is_taken_by_the_first_lane(info_json):
    """`prespawn` (the server's, before it loads the model) starts a child that imports while
    nothing needs it yet; the first lane to start one takes it (the same process) instead of
    waiting for a fresh child's imports, and compiles on it; no second child waits after.
    Closed idle, the lane hands it back for the next lane."""
    compile_worker.prespawn()
    spare = compile_worker._spare[0]
    compile_worker.prespawn()  # at most one waits
    assert compile_worker._spare[0] is spare
    lane = _lane(info_json)
    try:
        lane.start()
        assert lane.wait_started(120)
        assert lane._child[0] is spare
        assert compile_worker._spare is None
        assert lane.submit("regex", "[0-9]+").result(120) is not None
    finally:
        lane.close()
    lane._thread.join(30)
    assert compile_worker._spare[0] is spare and spare.poll() is None


def test_an_idle_closed_lanes_child_serves_the_next_lane_with_its_tokenizer(info_json):
    """A lane closed while its child is idle hands the child on (Engines started one after
    another in a process: no import each time); the next lane's tokenizer and whitespace rule
    replace the old ones there: its grammars are what a compiler of its own builds."""
    lane = _lane(info_json)
    lane.start()
    assert lane.wait_started(120)
    child = lane._child[0]
    assert lane.submit("regex", "[a-z]+").result(120) is not None
    lane.close()
    lane._thread.join(30)
    assert not lane._thread.is_alive() and not lane.started
    assert compile_worker._spare[0] is child and child.poll() is None

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok) + 64)  # another vocab
    compact = JsonWhitespace(any_whitespace=False)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    own = compile_worker.compile_grammar(xgr.GrammarCompiler(info), "json_schema", schema, compact)
    nxt = CompileLane(XGrammarCompiler(info), compact, 60, "t2")
    try:
        nxt.start()
        assert nxt.wait_started(120)
        assert nxt._child[0] is child  # taken, not started anew
        got = nxt.submit("json_schema", schema).result(120)
        assert got.serialize_json() == own.serialize_json()
        assert got.tokenizer_info.vocab_size == len(tok) + 64
    finally:
        nxt.close()


def test_wait_started_is_bounded_when_the_child_cannot_start(info_json, monkeypatch):
    """A lane never started waits only its bound; a child that cannot start (its Python
    cannot find its standard library) answers False instead of hanging, and the next job
    starts a fresh child that compiles."""
    spare = compile_worker._take_spare()  # an idle child an earlier lane handed on
    if spare is not None:
        compile_worker._end(spare)
    lane = _lane(info_json)
    try:
        assert lane.wait_started(0.2) is False
        monkeypatch.setenv("PYTHONHOME", "/nonexistent")
        lane.start()
        assert lane.wait_started(120) is False
        assert not lane.started
        monkeypatch.delenv("PYTHONHOME")
        assert lane.submit("regex", "[a-z]+").result(120) is not None
        assert lane.started
    finally:
        lane.close()


def test_a_closed_lane_ends_its_thread_and_refuses_jobs(info_json):
    """An Engine shut down must leave nothing running: `close` ends the lane's thread (it
    fails the jobs still queued) and its child; a job submitted afterwards fails at once
    instead of waiting forever."""
    lane = _lane(info_json)
    lane.start()
    assert lane.wait_started(120)
    child = lane._child[0]
    enum = json.dumps({"enum": [f"value {i}" for i in range(20000)]})
    lane.submit("json_schema", enum)  # seconds: the lane is compiling when it closes
    queued = [lane.submit("regex", f"[a-z]{{{n}}}") for n in range(1, 40)]
    while not lane._busy:
        time.sleep(0.01)
    lane.close()
    lane._thread.join(30)
    assert not lane._thread.is_alive()
    assert child.poll() is not None
    assert all(f.done() for f in queued)
    # not cancelled: a request waiting for its grammar hears why (a 400), where a cancelled
    # future raised CancelledError into it (a stream of several requests then never ended)
    assert not any(f.cancelled() for f in queued)
    assert all(f.exception() is None or isinstance(f.exception(), GrammarError) for f in queued)
    late = lane.submit("regex", "[a-z]+")
    with pytest.raises(GrammarError, match="shut down"):
        late.result(1)
