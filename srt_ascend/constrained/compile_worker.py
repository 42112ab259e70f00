"""Grammar compiles in a child process that can be stopped: xgrammar's compiler is native code
that no thread can interrupt, and some grammars (a JSON-schema enum of 60,000 values) take
minutes. A `CompileLane` owns one child (`python -m srt_ascend.constrained.compile_child`) and
compiles its jobs one at a time, first come first served; a compile that runs past the lane's
timeout has its child killed (a fresh one starts for the next job) and fails its future.

The child says "started" once it has imported xgrammar and built its compiler (seconds of CPU
on a small machine): `wait_started` lets the server report ready only after that, so the
import does not compete with the first requests' forwards for the cores. A lane closed while
its child is idle hands the child back for the next lane in the process (Engines started one
after another: notebooks, test suites), which gives it its own tokenizer and finds it
started at once instead of importing anew; at most one such child waits, and it ends with
the process.

What the child compiles with is the lane's compiler's (compilers.py, --grammar-backend): the
lane sends it the compiler's picklable setup, the child builds its half from it and answers
each job with a payload (xgrammar's serialized CompiledGrammar; llguidance's validated
grammar) that the parent's half loads; a grammar that does not compile comes back as the
library's message.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

import xgrammar as xgr

# xgrammar prefixes messages with "[time] file.cc:line: " and sometimes "Check failed: (...)
# is false: "; users get the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
START_TIMEOUT = 300.0  # seconds a child may take to start (imports), not counted as compiling
CLOSE_TIMEOUT = 10.0  # seconds `close` waits for the lane's thread (a killed child's answer)
_CHILD = "srt_ascend.constrained.compile_child"  # runs `serve` in the child
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's sampling-parameter names


class GrammarError(ValueError):
    """A grammar that is refused: xgrammar cannot compile it (its message), or it is over a
    limit (the message names the flag)."""


@dataclass(frozen=True)
class JsonWhitespace:
    """How JSON-schema grammars treat whitespace between JSON tokens."""

    any_whitespace: bool = True  # False: compact JSON
    max_count: int | None = None  # most consecutive whitespace characters; None: unbounded


def compile_grammar(
    compiler: xgr.GrammarCompiler, kind: str, source: str, ws: JsonWhitespace
) -> xgr.CompiledGrammar:
    """Compiles (kind, source) with xgrammar; GrammarError with xgrammar's message (its
    source-location prefix cut) for an unknown kind or a grammar that does not compile."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(
                source, any_whitespace=ws.any_whitespace, max_whitespace_cnt=ws.max_count
            )
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "ebnf":
            return compiler.compile_grammar(source)
        return compiler.compile_structural_tag(source)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"invalid {kind}: {_XGR_PREFIX.sub('', str(e)).strip()}") from e


_CLOSE = object()  # `CompileLane.close`'s last item: its thread returns


class CompileLane:
    """One child process compiling jobs in order, each bounded by `timeout` seconds (None: no
    bound). Thread-safe; `submit` never blocks."""

    def __init__(self, compiler, ws: JsonWhitespace, timeout: float | None, name: str) -> None:
        """`compiler`: the parent half of a grammar library (compilers.COMPILERS)."""
        self._compiler, self._ws, self._timeout = compiler, ws, timeout
        self._setup = compiler.setup()
        self._jobs: queue.Queue = queue.Queue()
        self._closing = threading.Lock()  # `close` and `submit`: no job queued after the end
        self._child: tuple[subprocess.Popen, Connection, Connection] | None = None
        self._closed = False
        self._busy = False  # the lane's thread is using the child (`close` then kills it)
        self._kill_lock = threading.Lock()
        # whether the current child said "started": None while none is running or one is
        # starting, False once a start failed (the next job tries a fresh child)
        self._start_state: bool | None = None
        self._start_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"grammar-{name}")
        self._thread.start()

    def submit(self, kind: str, source: str) -> Future:
        """Future of the CompiledGrammar; GrammarError if it does not compile, or does not
        within the timeout."""
        fut: Future = Future()
        with self._closing:
            if self._closed:
                fut.set_exception(GrammarError("the grammar compiler has shut down"))
            else:
                self._jobs.put((kind, source, fut))
        return fut

    def start(self) -> None:
        """Starts the child now (it imports xgrammar: seconds) instead of at the first job."""
        self._jobs.put(None)

    @property
    def started(self) -> bool:
        """Whether the lane's child is running and has said "started" (imports done)."""
        child = self._child
        return self._start_state is True and child is not None and child[0].poll() is None

    def wait_started(self, timeout: float) -> bool:
        """Waits at most `timeout` seconds for the child (see `start`) to say "started";
        False if it did not by then, or its start failed (it exited first)."""
        with self._start_cond:
            self._start_cond.wait_for(lambda: self._start_state is not None, timeout)
            return self._start_state is True

    def _set_started(self, state: bool | None) -> None:
        with self._start_cond:
            self._start_state = state
            self._start_cond.notify_all()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _CLOSE:  # the last item: `close` queues nothing after it
                self._retire()
                return
            with self._closing:
                closed = self._closed
                self._busy = not closed  # a start or a compile on the child
            if closed:  # a queued job fails with a reason (a 400), not cancelled
                if job is not None and job[2].set_running_or_notify_cancel():
                    job[2].set_exception(GrammarError("the grammar compiler has shut down"))
                continue
            if job is None:
                try:
                    self._ensure_child()
                except GrammarError:  # logged by wait_started's caller; a job retries
                    pass
                self._busy = False
                continue
            kind, source, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self._compile(kind, source))
                except Exception as e:  # noqa: BLE001 - the future carries every failure
                    fut.set_exception(e)
            self._busy = False

    def _ensure_child(self) -> tuple[subprocess.Popen, Connection, Connection]:
        """The running child, or a new one once it said "started"; GrammarError (the child
        killed) if it exits or stays silent for START_TIMEOUT seconds first."""
        if self._child is None or self._child[0].poll() is not None:
            self._set_started(None)
            self._child = _take_spare() or _spawn()
            _, send, recv = self._child
            try:
                send.send((self._setup, self._ws))  # read by the child once imported
                started = recv.poll(START_TIMEOUT) and recv.recv() == "started"
            except (EOFError, OSError):  # the child exited (it could not import or start)
                started = False
            if not started:
                self._kill()
                self._set_started(False)
                raise GrammarError("the grammar compiler did not start")
            self._set_started(True)
        return self._child

    def _compile(self, kind: str, source: str):
        _, send, recv = self._ensure_child()
        try:
            send.send((kind, source))
        except OSError:  # the child is gone (killed from outside): the next job starts one
            self._kill()
            raise GrammarError(f"the grammar compiler exited before compiling a {kind}") from None
        late = (
            f"{kind} did not compile within --grammar-compile-timeout {self._timeout} s; "
            "simplify it (e.g. fewer enum values)"
        )
        ok, payload = self._answer(kind, recv, self._timeout, late)
        if not ok:
            raise GrammarError(payload)
        return self._compiler.load(payload)

    def _answer(self, kind: str, recv: Connection, timeout: float | None, late: str):
        """The child's next message within `timeout` seconds; else the child is killed and
        GrammarError(`late`) raised."""
        try:
            if recv.poll(timeout):
                return recv.recv()
        except (EOFError, OSError):
            late = f"the grammar compiler exited while compiling a {kind}"
        self._kill()
        raise GrammarError(late)

    def _kill(self) -> None:
        with self._kill_lock:  # the lane's thread and close() may both kill
            child, self._child = self._child, None
        if self._start_state is True:
            self._set_started(None)
        if child is not None:
            _end(child)

    def _retire(self) -> None:
        """The lane's thread at its end: an idle, started child is told to drop its tokenizer
        and offered to the next lane (`_offer_spare`); any other is killed."""
        with self._kill_lock:
            child, self._child = self._child, None
        if child is None:
            return
        self._set_started(None)
        try:
            child[1].send(None)  # the child waits for its next tokenizer info
        except OSError:
            pass
        else:
            if child[0].poll() is None and _offer_spare(child):
                return
        _end(child)

    def close(self) -> None:
        """Ends the lane: a compile in progress is abandoned (its child killed), queued jobs
        fail with GrammarError, and an idle child is handed on (`_retire`); returns once the
        lane's thread has."""
        with self._closing:
            self._closed = True
            self._jobs.put(_CLOSE)  # the lane's thread fails what is queued, then returns
            busy = self._busy
        if busy:
            self._kill()
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_TIMEOUT)


Child = tuple[subprocess.Popen, Connection, Connection]  # the process, its jobs, its answers
_spare: Child | None = None  # a child started ahead of the lane that takes it (`prespawn`)
_spare_lock = threading.Lock()


def _spawn() -> Child:
    """A new child; it imports xgrammar, then waits for its tokenizer info."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", _CHILD, str(to_child_r), str(from_child_w)],
        pass_fds=(to_child_r, from_child_w),
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": _import_path()},
    )
    os.close(to_child_r)
    os.close(from_child_w)
    return proc, Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)


def prespawn() -> None:
    """Starts a child now, before any lane needs one: the server calls this before it loads
    the model, so that the child's imports (seconds of CPU) overlap the load instead of
    delaying readiness; the first lane that starts a child takes it. At most one waits."""
    global _spare
    with _spare_lock:
        if _spare is None or _spare[0].poll() is not None:
            _spare = _spawn()


def _end(child: Child) -> None:
    proc, send, recv = child
    proc.kill()
    proc.wait()
    send.close()
    recv.close()


def _offer_spare(child: Child) -> bool:
    """Keeps an idle child (told to wait for a tokenizer) for the next lane that starts one;
    False if one already waits."""
    global _spare
    with _spare_lock:
        if _spare is not None and _spare[0].poll() is None:
            return False
        _spare = child
    return True


def _take_spare() -> Child | None:
    """The child `prespawn` started, if it is still running."""
    global _spare
    with _spare_lock:
        child, _spare = _spare, None
    if child is None or child[0].poll() is None:
        return child
    child[1].close()
    child[2].close()
    return None


def _import_path() -> str:
    """PYTHONPATH for the child: this package's root first (the same code as the parent)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def serve(recv: Connection, send: Connection) -> None:
    """The child: reads its compiler's setup and says "started" once the compiler is built;
    then reads (kind, source) jobs and answers each with (True, payload) or (False, message),
    until a None job (its lane closed: the next message is another lane's setup). It returns
    quietly when the parent goes away: its pipe closed (EOFError), cut in the middle of a
    message (OSError: the parent was killed or exited while sending), or closed while the
    child answers (BrokenPipeError)."""
    try:
        while True:
            setup, ws = recv.recv()
            compiler = setup.build(ws)
            send.send("started")
            while (job := recv.recv()) is not None:
                kind, source = job
                try:
                    answer = (True, compiler.compile(kind, source))
                except GrammarError as e:
                    answer = (False, str(e))
                send.send(answer)
            del compiler
    except (EOFError, OSError):  # BrokenPipeError is an OSError
        return
