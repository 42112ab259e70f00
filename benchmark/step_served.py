"""The served step that `step_overhead.py` measures: the server in a child process with timers
wrapped around the parts of a step (PARTS) and GC callbacks, streaming clients here, and the
records turned into ms per decode step (`breakdown`) and host / device time per step
(`per_step`)."""

from __future__ import annotations

import bisect
import collections
import gc
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch
from step_bare import server_flags
from stream_client import stream_generate

# (label, "module:owner", method or None for a module function) of every timed part; the
# label's indent shows nesting.
PARTS = [
    ("step (decode)", "srt_ascend.managers.scheduler:Scheduler", "_run_decode"),
    # overlap scheduling (the default): a decode step is launched, then finished a step later
    ("step (overlapped)", "srt_ascend.managers.scheduler:Scheduler", "_finish_step"),
    ("  launch", "srt_ascend.decoding.plain:PlainDecoder", "launch"),
    ("  launch", "srt_ascend.speculative.mtp_decoder:MTPDecoder", "launch"),
    ("  finish", "srt_ascend.decoding.plain:PlainDecoder", "finish"),
    ("  finish", "srt_ascend.speculative.mtp_decoder:MTPDecoder", "finish"),
    ("  kv alloc", "srt_ascend.managers.kv_book:KVBook", "alloc_running"),
    ("  batch build", "srt_ascend.model_executor.model_runner:ModelRunner", "build_forward_batch"),
    ("  forward + logits", "srt_ascend.model_executor.model_runner:ModelRunner", "forward_logits"),
    # every forward of a step (main model and MTP module, replayed or eager): "device" time
    ("    forward", "srt_ascend.model_executor.model_runner:ModelRunner", "_run"),
    ("    graph replay", "srt_ascend.model_executor.graph_runner:GraphRunner", "run"),
    # a whole MTP round replayed as one graph (mtp_round_graph): its forwards, "device" time
    ("    round replay", "srt_ascend.speculative.mtp_round_graph:MTPRoundGraphs", "run"),
    ("    eager logits", "srt_ascend.model_executor.model_runner:ModelRunner", "compute_logits"),
    ("  sample + read", "srt_ascend.decoding.base:sample_rows", None),
    # a thread waiting for a launched step's result (overlap: the finish reads step N's
    # tokens; only the waits inside a timed step count, see `per_step`)
    ("  wait", "concurrent.futures:Future", "result"),
    ("  commit", "srt_ascend.managers.scheduler:Scheduler", "_commit"),
    ("    stop check", "srt_ascend.managers.stop_checker:StopChecker", "check"),
    ("  batch log", "srt_ascend.managers.batch_log:BatchLog", "decode"),
    ("  release", "srt_ascend.managers.kv_book:KVBook", "release"),
    ("  emit", "srt_ascend.managers.scheduler:Scheduler", "_flush_outputs"),
    ("loop: receive", "srt_ascend.managers.scheduler:Scheduler", "_receive"),
    ("prefill", "srt_ascend.managers.scheduler:Scheduler", "_run_prefill"),
    ("dispatch", "srt_ascend.managers.tokenizer_manager:TokenizerManager", "_dispatch"),
    ("detokenize", "srt_ascend.managers.detokenizer:DecodeState", "update"),
    ("response", "srt_ascend.managers.tokenizer_manager:TokenizerManager", "_response"),
]


# ---- the server, timed -----------------------------------------------------------------------


def _resolve(path: str):
    module, _, name = path.partition(":")
    obj = __import__(module, fromlist=["_"])
    return obj, name


def install_timers(records: list) -> None:
    """Wraps every part of PARTS (and GC) so each call appends (label, thread, start, wall s,
    the thread's CPU s)."""
    for label, path, attr in PARTS:
        owner, name = _resolve(path)
        if attr is None:  # a module-level function
            target, attr = owner, name
        else:
            target = getattr(owner, name)
        fn = getattr(target, attr)

        def timed(*args, _fn=fn, _label=label, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _fn(*args, **kw)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                records.append((_label, threading.current_thread().name, t0, t1 - t0, c1 - c0))

        setattr(target, attr, timed)
    started = {}

    def on_gc(phase, info):
        me = threading.current_thread().name
        if phase == "start":
            started[me] = time.perf_counter(), time.thread_time()
        elif me in started:
            t0, c0 = started.pop(me)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            records.append((f"gc gen{info['generation']}", me, t0, dt, cpu))

    gc.callbacks.append(on_gc)


def serve(argv: list[str], records_path: str, switch_interval: float | None) -> None:
    """The child process: the server with timers, until SIGTERM; then the records to a file."""
    if switch_interval:
        sys.setswitchinterval(switch_interval)

    records: list = []
    install_timers(records)
    from srt_ascend.launch_server import run
    from srt_ascend.server_args import prepare_server_args

    try:
        run(prepare_server_args(argv))
    finally:
        with open(records_path, "w") as f:
            json.dump(records, f)


def wait_ready(url: str, proc) -> None:
    """/health answers and every shape is compiled."""
    while True:
        if not proc.is_alive():
            raise RuntimeError("the server exited")
        try:
            info = json.load(urllib.request.urlopen(url + "/server_info", timeout=2))
            state = info.get("internal_states", [{}])[0]
            if state.get("torch_compile", {}).get("ready", True):
                return
        except OSError:
            pass
        time.sleep(1)


def client(
    port: int, a, prompts: list[list[int]], c: int | None = None
) -> tuple[float, float, list[float]]:
    """(wall start, wall end, TPOT ms per request) of `c` (default `a.concurrency`) streams at
    a time, each sending its share of `prompts` one after another."""
    start = time.perf_counter()
    tpots: list[float] = []

    def one_stream(share):
        for ids in share:
            url = f"http://127.0.0.1:{port}"
            _, t, tokens = stream_generate(url, ids, a.output_len, a.temperature)
            # bench_serving's TPOT: per token after the first, not per chunk
            tpots.append((t[-1] - t[0]) / (tokens - 1) * 1e3)

    c = c or a.concurrency
    streams = [threading.Thread(target=one_stream, args=(prompts[i::c],)) for i in range(c)]
    for t in streams:
        t.start()
    for t in streams:
        t.join()
    return start, time.perf_counter(), tpots


def breakdown(records: list, start: float, end: float) -> tuple[dict, dict]:
    """Per "thread | label" in [start, end]: ms per decode step as the median call times the
    calls per step (a stalled step, hundreds of ms when a compiled forward's threads are
    descheduled, would swamp a mean; the mean is kept beside it), and step counts. A receive
    that waited for the next request (over 20 ms: no work) is the client's time."""
    inside = [
        r for r in records if start <= r[2] <= end and not (r[0] == "loop: receive" and r[3] > 0.02)
    ]
    steps = [r for r in inside if r[0] in ("step (decode)", "step (overlapped)")]
    n = max(1, len(steps))
    calls: dict[str, list[float]] = collections.defaultdict(list)
    for label, thread, _, dt, *_ in inside:
        calls[f"{thread} | {label}"].append(dt)
    starts = sorted(r[2] for r in steps)
    periods = [b - s for s, b in zip(starts, starts[1:]) if b - s < 0.1]  # within a request
    counts = {
        "decode_steps": len(steps),
        "step_period_ms": round(statistics.median(periods) * 1e3, 3) if periods else None,
    }
    parts = {
        k: {
            "median_ms": round(statistics.median(v) * len(v) / n * 1e3, 3),
            "mean_ms": round(sum(v) / n * 1e3, 3),
        }
        for k, v in calls.items()
    }
    return parts, counts


def py_spy_profile(pid: int, port: int, a, prompts) -> dict:
    """Each thread's 12 most frequent frames (inclusive, % of that thread's samples)."""
    raw = a.py_spy
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--threads",
            "--nonblocking",
            "--rate",
            "500",
            "-o",
            raw,
            *(["--gil"] if a.gil else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2)
    client(port, a, prompts)
    spy.send_signal(2)
    spy.wait()
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            thread, count = frames[0], int(count)
            samples[thread] += count
            for frame in set(frames[1:]):
                per_thread[thread][frame.split(" (")[0]] += count
    return {
        t: {f: round(100 * c / samples[t], 1) for f, c in per_thread[t].most_common(12)}
        for t in per_thread
        if samples[t] >= 50
    }


class TimedServer:
    """A server (`launch_server.run` with timers, in a spawned child) on a free port."""

    def __init__(self, a) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.tmp = tempfile.mkdtemp()
        self.records_path = os.path.join(self.tmp, "records.json")
        argv = ["--model-path", a.model, "--port", str(self.port), "--log-level", "warning"]
        self.proc = multiprocessing.get_context("spawn").Process(
            target=serve,
            args=([*argv, *server_flags(a)], self.records_path, a.switch_interval),
        )
        self.launched = time.perf_counter()
        self.proc.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> float:
        """s from launch to serving with every shape compiled."""
        wait_ready(self.url, self.proc)
        return round(time.perf_counter() - self.launched, 1)

    def state(self) -> dict:
        info = json.load(urllib.request.urlopen(self.url + "/server_info", timeout=30))
        return info.get("internal_states", [{}])[0]

    def stop(self) -> list:
        """Stops the server; its timer records."""
        self.proc.terminate()
        self.proc.join(60)
        try:
            with open(self.records_path) as f:
                return json.load(f)
        finally:
            shutil.rmtree(self.tmp)


def make_prompts(a, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 8000, (a.input_len,), generator=g).tolist() for _ in range(n)]


def accept_length(before: dict, after: dict) -> float | None:
    """MTP's mean accept length over the steps between two /server_info states."""
    n = after.get("spec_num_verify", 0) - before.get("spec_num_verify", 0)
    acc = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    return round(1 + acc / n, 3) if n else None


def served(a) -> dict:
    server = TimedServer(a)
    try:
        ready_s = server.wait_ready()  # every shape compiled (the bare run's cache)
        prompts = make_prompts(a, a.num_prompts + 2 * a.concurrency, 1)
        warm = 2 * a.concurrency
        client(server.port, a, prompts[:warm])  # warm-up
        start, end, tpots = client(server.port, a, prompts[warm:])
        spy = py_spy_profile(server.proc.pid, server.port, a, prompts[warm:]) if a.py_spy else None
    finally:
        records = server.stop()
    parts, counts = breakdown(records, start, end)
    return {
        "tpot_ms": round(statistics.median(tpots), 3),
        "ready_s": ready_s,
        **counts,
        "per_step": per_step(records, start, end),
        "parts": parts,
        "py_spy": spy,
    }


# ---- host and device time per step -------------------------------------------------------

STEP_LABELS = ("step (decode)", "step (overlapped)")
# the model's forwards and LM heads, and whole-round graph replays
DEVICE_LABELS = ("    forward", "    eager logits", "    round replay")
# the scheduler's own step work: the serial step, or an overlapped step's launch and finish
HOST_LABELS = ("step (decode)", "step (overlapped)", "  launch")


def per_step(records: list, start: float, end: float) -> dict:
    """Medians over the decode steps in [start, end] of: the step period (from one step's
    start to the next's), the device time in it (every forward and eager LM head that
    started in it: `DEVICE_LABELS`), the host time exposed (period - device: what the
    device would idle), and the host work (the scheduler's step calls, `HOST_LABELS`,
    less the forwards and result waits inside them: with overlap it runs beside the
    forward), in wall time and in the calling threads' CPU time (`host_cpu`: what a loaded
    host's descheduling and GIL waits do not inflate). Periods with a prefill in them, or
    over 1 s (the client between requests), are left out."""
    inside = [r for r in records if start <= r[2] <= end]
    starts = sorted(r[2] for r in inside if r[0] in STEP_LABELS)
    prefills = sorted(r[2] for r in inside if r[0] == "prefill")
    device = sorted((r[2], r[3], r[1]) for r in inside if r[0] in DEVICE_LABELS)
    device_starts = [d[0] for d in device]
    # what a host call spends not working: forwards it runs, results it waits for
    idle = sorted((*r[2:5], r[1]) for r in inside if r[0] in DEVICE_LABELS or r[0] == "  wait")
    idle_starts = [d[0] for d in idle]
    host = [r for r in inside if r[0] in HOST_LABELS]
    host.sort(key=lambda r: r[2])
    host_starts = [r[2] for r in host]
    periods, dev, exposed, work, work_cpu = [], [], [], [], []
    for lo, hi in zip(starts, starts[1:]):
        if hi - lo > 1.0 or any(lo <= p < hi for p in prefills):
            continue
        i, j = bisect.bisect_left(device_starts, lo), bisect.bisect_left(device_starts, hi)
        d = sum(dt for _, dt, _ in device[i:j])
        calls = host[bisect.bisect_left(host_starts, lo) : bisect.bisect_left(host_starts, hi)]
        w = w_cpu = 0.0
        for _label, thread, t0, dt, cpu in calls:
            nested, nested_cpu = _nested(idle, idle_starts, thread, t0, dt)
            w += dt - nested
            w_cpu += cpu - nested_cpu
        periods.append(hi - lo)
        dev.append(d)
        exposed.append(hi - lo - d)
        work.append(w)
        work_cpu.append(w_cpu)
    if not periods:
        return {"steps": 0}

    def med(v):
        return round(statistics.median(v) * 1e3, 3)

    return {
        "steps": len(periods),
        "raw_ms": {  # per step, in order: to recompute any other statistic
            k: [round(x * 1e3, 3) for x in v]
            for k, v in (("period", periods), ("device", dev), ("exposed", exposed), ("host", work))
        },
        "period_ms": med(periods),
        "device_ms": med(dev),
        "host_exposed_ms": med(exposed),
        "host_work_ms": med(work),
        "host_cpu_ms": med(work_cpu),
    }


def _nested(idle: list, idle_starts: list, thread: str, t0: float, dt: float):
    """(wall s, CPU s) of the idle calls (`per_step`'s forwards and waits) that `thread`
    made inside its call [t0, t0 + dt], outermost ones only."""
    k = bisect.bisect_left(idle_starts, t0)
    nested = nested_cpu = 0.0
    covered = t0
    while k < len(idle) and idle[k][0] <= t0 + dt:
        start_k, dt_k, cpu_k, thread_k = idle[k]
        if thread_k == thread and start_k >= covered and start_k + dt_k <= t0 + dt:
            nested += dt_k
            nested_cpu += cpu_k
            covered = start_k + dt_k
        k += 1
    return nested, nested_cpu
