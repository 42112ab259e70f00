"""Serving overhead: the bare decode forward beside the step it serves.

    python benchmark/step_overhead.py --matrix [--quick] [--modes eager compiled]
        [--specs plain mtp] [--mtp-k 1] [--concurrencies 1 16] [--json-out FILE]
    python benchmark/step_overhead.py [--compile] [--spec plain|mtp] [--concurrency 1]
        [--input-len 64] [--output-len 64] [--num-prompts 16] [--context-length 256]
        [--py-spy FILE [--gil]] [--switch-interval S] [--json-out FILE]
        [--server-flags --num-threads 1 ...]
    python benchmark/step_overhead.py --core-contention [--size 700] [--iters 100]

`--matrix`: host and device time per decode step, served against bare, for every cell of
{eager, compiled} x {plain, MTP K = --mtp-k} x {1, 16 requests} x {overlap on, off} in one
run (`matrix`; `--quick`: 32 output tokens, 2 measured requests per stream, 50 bare
iterations: minutes with a warm compile cache). Per (mode, decoder): the bare forwards in a
child process at every concurrency, then an overlap-on and an overlap-off server side by
side, the client runs interleaved between them with the same prompts. Per step (medians over
the measured steps, `per_step`): the period, the device time (every forward and eager LM
head: on CPU the device is the host's cores, so "device" means the model's forwards), the
host time exposed (period - device: what a device would idle) and the host work (the
scheduler's step calls less the forwards inside them; overlapped, it runs beside the
forward). Ratios: step period / bare and device in the step / bare.

One run (without --matrix), shipped checkpoint, bf16, greedy, `--concurrency` C requests at
a time, MTP off (`--spec mtp`: K = --mtp-k):
1. bare: a ModelRunner with the server's settings (graphs at batch C; `--compile`:
   compiled), in a child process's main thread, replays the decode forward (the LM head
   inside its graph) back to back over C requests with KV of the served mean length: the
   forward alone, and the least a step needs (batch build + forward + argmax read);
   compiled, also the forward without dynamo's guard evaluation. MTP: one round's forwards
   (`MTPDecoder._padding_step`: draft steps, verify and its logits, the MTP pass) over C
   padding requests with a context of the served mean length.
2. served: the same settings as a server (`launch_server.run` in a child process, with timers
   wrapped around the parts of a step and GC callbacks), and C streaming clients here each
   send their share of the prompts one after another to /generate; TPOT per request from the
   chunks' arrival times (bench_serving's definition: (last - first) / (tokens - 1)), median
   over requests.
The breakdown is ms per decode step of each timed part during the measured requests, in the
scheduler thread (the step) and in the event loop thread (output dispatch, detokenization,
response building; the HTTP streaming itself is what the loop spends beyond them).
`--py-spy FILE` then repeats the client run under `py-spy record` (pip install py-spy; a tool,
not a dependency; `--gil`: only the thread holding the GIL is sampled), keeps the raw samples
in FILE and prints each thread's most frequent frames: the sampler costs CPU itself, so those
times are not comparable with the timed run. `--switch-interval` sets the server's
`sys.setswitchinterval` (an experiment on GIL hand-offs). With overlap ("step (overlapped)" is
the finish of a launched step, in the loop's thread, and the forward runs in the device
worker's, `srt-scheduler`; the default with compiled forwards, `--enable-overlap-schedule`
for eager ones) or the serial loop ("step (decode)"; `--disable-overlap-schedule`).

`--core-contention`: whether this machine's cores run independently, which decides whether
overlap can hide host work at all: a one-thread `--size` square float32 matmul alone, beside a
busy process, and beside a busy Python thread of its own process (median ms over `--iters`,
the ratios to alone: 1.0x means independent cores; on a VM whose two vCPUs share one core's
capacity anything beside a forward slows it). Run it first on a new host.
"""

from __future__ import annotations

import argparse
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
from machine import machine_info
from stream_client import stream_generate

from srt_ascend.server_args import SHIPPED_MODEL

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


def server_flags(a) -> list[str]:
    """The server's flags for a run at concurrencies `a.buckets` (graphs at each of them;
    `a.compile`: compiled; `a.mtp_k`: MTP with that many drafts; `a.overlap` False:
    --disable-overlap-schedule, True: --enable-overlap-schedule, which eager CPU forwards
    need, None: the platform's default), then `a.server_flags`."""
    buckets = [str(c) for c in a.buckets]
    flags = ["--context-length", str(a.context_length)]
    flags += ["--max-running-requests", str(max(4, *a.buckets))]
    flags += ["--cuda-graph-bs", *buckets, "--enable-cpu-graph"]
    if a.compile:
        flags += ["--enable-torch-compile", "--torch-compile-max-bs", str(max(a.buckets))]
    if a.mtp_k:
        flags += ["--speculative-algorithm", "MTP", "--speculative-num-steps", str(a.mtp_k)]
    if a.overlap is not None:
        flags += ["--enable-overlap-schedule" if a.overlap else "--disable-overlap-schedule"]
    return flags + a.server_flags


# ---- bare forward --------------------------------------------------------------------------


def bare(a) -> dict:
    """Per concurrency C in `a.buckets`: ms of the step's forwards back to back in this
    process's main thread (graph replays). Plain: one decode forward over C requests with KV
    of the served mean length, and the least step around it (batch build + forward + argmax
    read); compiled, also the forward without dynamo's guard evaluation. MTP: one round's
    forwards (`MTPDecoder._padding_step`: the K-1 draft steps, the verify forward with its
    logits, the MTP pass and its drafting head) over C padding requests whose context is the
    served mean length."""
    import srt_ascend.speculative.mtp_decoder  # noqa: F401  (registers "MTP")
    from srt_ascend.decoding import DecoderHandles, create_decoder
    from srt_ascend.model_executor.model_runner import ModelRunner
    from srt_ascend.platforms import get_platform
    from srt_ascend.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", a.model, *server_flags(a)])
    args = args.for_device("cpu")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    runner = ModelRunner(args, get_platform("cpu"))
    decoder = create_decoder(args, DecoderHandles(runner, None, None, []))
    prefix = a.input_len + a.output_len // 2  # the served mean KV length
    t0 = time.perf_counter()
    runner.capture_graphs(decoder.graph_kinds(), smallest_kv_window=_pow2_at_least(prefix + 1))
    while runner.compile_next_graph():
        pass
    out = {"compile_s": round(time.perf_counter() - t0, 1)}
    # built and compiled outside inference mode, as the server does (a runner whose pool and
    # buffers are inference tensors cannot be packaged); the forwards run inside it
    with torch.inference_mode():
        return _bare_forwards(a, runner, decoder, prefix, out)


def _bare_forwards(a, runner, decoder, prefix: int, out: dict) -> dict:
    """`bare`'s timings over a built runner, in inference mode."""
    from srt_ascend.model_executor.forward_batch import ForwardMode

    if a.mtp_k:
        from srt_ascend.speculative import mtp_decoder

        mtp_decoder.PROFILE_CONTEXT = prefix
        for n in a.buckets:
            out[n] = {
                "forward_ms": median_ms(lambda n=n: decoder._padding_step(n, a.mtp_k), a.iters)
            }
        return out
    kind = decoder.kind
    g = torch.Generator().manual_seed(0)
    pool = runner.kv_pool
    all_rows = runner.req_to_token_pool.alloc(max(a.buckets))
    all_locs = []
    for row in all_rows:
        slots = runner.allocator.alloc(prefix + 1)
        runner.req_to_token_pool.write([row], [0], slots, [prefix + 1])
        for layer in range(runner.num_layers):
            c = torch.randn(prefix, pool.kv_lora_rank, generator=g)
            k_pe = torch.randn(prefix, pool.qk_rope_head_dim, generator=g)
            pool.set_mla_kv_buffer(layer, slots[:prefix], c, k_pe)
        all_locs.append(slots[prefix:])
    for n in a.buckets:
        rows, loc = all_rows[:n], torch.cat(all_locs[:n])

        def batch(rows=rows, loc=loc, n=n):
            return runner.build_forward_batch(
                ForwardMode.DECODE, [5] * n, rows, [prefix + 1] * n, [1] * n, loc
            )

        fb = batch()

        def forward(fb=fb):  # the graph's LM head included
            runner.forward_logits(fb, kind)

        def least_step(batch=batch):
            _, logits = runner.forward_logits(batch(), kind)
            logits.argmax(dim=-1).tolist()

        res = {
            name: median_ms(fn, a.iters)
            for name, fn in (("forward_ms", forward), ("least_step_ms", least_step))
        }
        if a.compile and not a.matrix:  # dynamo's guards: the forward without them, then with
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                res["forward_no_guards_ms"] = median_ms(forward, a.iters)
            res["forward_again_ms"] = median_ms(forward, a.iters)
        out[n] = res
    return out


def bare_child(a, queue) -> None:
    """`bare` in a fresh process's main thread (each configuration its own process: no
    compiled state or thread setting carries over); the result (or the error) to `queue`."""
    try:
        queue.put(bare(a))
    except BaseException as e:
        queue.put({"error": repr(e)})
        raise


def bare_in_child(a) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=bare_child, args=(a, queue))
    proc.start()
    res = queue.get()
    proc.join()
    if "error" in res:
        raise RuntimeError(f"bare run failed: {res['error']}")
    return res


def _pow2_at_least(n: int) -> int:
    w = 64
    while w < n:
        w *= 2
    return w


def median_ms(fn, iters: int) -> float:
    """Median wall time of `fn` in ms over `iters` calls, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


# ---- the server, timed -----------------------------------------------------------------------


def _resolve(path: str):
    module, _, name = path.partition(":")
    obj = __import__(module, fromlist=["_"])
    return obj, name


def install_timers(records: list) -> None:
    """Wraps every part of PARTS (and GC) so each call appends (label, thread, start, s)."""
    for label, path, attr in PARTS:
        owner, name = _resolve(path)
        if attr is None:  # a module-level function
            target, attr = owner, name
        else:
            target = getattr(owner, name)
        fn = getattr(target, attr)

        def timed(*args, _fn=fn, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                t1 = time.perf_counter()
                records.append((_label, threading.current_thread().name, t0, t1 - t0))

        setattr(target, attr, timed)
    started = {}

    def on_gc(phase, info):
        me = threading.current_thread().name
        if phase == "start":
            started[me] = time.perf_counter()
        elif me in started:
            t0 = started.pop(me)
            records.append((f"gc gen{info['generation']}", me, t0, time.perf_counter() - t0))

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
            _, t, tokens = stream_generate(f"http://127.0.0.1:{port}", ids, a.output_len)
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
    for label, thread, _, dt in inside:
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
DEVICE_LABELS = ("    forward", "    eager logits")  # the model's forwards and LM heads
# the scheduler's own step work: the serial step, or an overlapped step's launch and finish
HOST_LABELS = ("step (decode)", "step (overlapped)", "  launch")


def per_step(records: list, start: float, end: float) -> dict:
    """Medians over the decode steps in [start, end] of: the step period (from one step's
    start to the next's), the device time in it (every forward and eager LM head that
    started in it: `DEVICE_LABELS`), the host time exposed (period - device: what the
    device would idle), and the host work (the scheduler's step calls, `HOST_LABELS`,
    less the forwards and result waits inside them: with overlap it runs beside the
    forward). Periods with a
    prefill in them, or over 1 s (the client between requests), are left out."""
    inside = [r for r in records if start <= r[2] <= end]
    starts = sorted(r[2] for r in inside if r[0] in STEP_LABELS)
    prefills = sorted(r[2] for r in inside if r[0] == "prefill")
    device = sorted((r[2], r[3], r[1]) for r in inside if r[0] in DEVICE_LABELS)
    device_starts = [d[0] for d in device]
    # what a host call spends not working: forwards it runs, results it waits for
    idle = sorted((r[2], r[3], r[1]) for r in inside if r[0] in DEVICE_LABELS or r[0] == "  wait")
    idle_starts = [d[0] for d in idle]
    host = [r for r in inside if r[0] in HOST_LABELS]
    host.sort(key=lambda r: r[2])
    host_starts = [r[2] for r in host]
    periods, dev, exposed, work = [], [], [], []
    for lo, hi in zip(starts, starts[1:]):
        if hi - lo > 1.0 or any(lo <= p < hi for p in prefills):
            continue
        i, j = bisect.bisect_left(device_starts, lo), bisect.bisect_left(device_starts, hi)
        d = sum(dt for _, dt, _ in device[i:j])
        w = 0.0
        for _label, thread, t0, dt in host[
            bisect.bisect_left(host_starts, lo) : bisect.bisect_left(host_starts, hi)
        ]:
            k = bisect.bisect_left(idle_starts, t0)
            nested, covered = 0.0, t0  # nested calls of the same thread, outermost only
            while k < len(idle) and idle[k][0] <= t0 + dt:
                start_k, dt_k, thread_k = idle[k]
                if thread_k == thread and start_k >= covered and start_k + dt_k <= t0 + dt:
                    nested += dt_k
                    covered = start_k + dt_k
                k += 1
            w += dt - nested
        periods.append(hi - lo)
        dev.append(d)
        exposed.append(hi - lo - d)
        work.append(w)
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
    }


# ---- the matrix: overlap on/off x plain/MTP x eager/compiled x concurrencies ----------------


def matrix(a) -> dict:
    """Every cell in one run. Per (mode, speculation): the bare forwards at every
    concurrency (a child process), then two servers, overlap on and off, both up, and the
    client runs interleaved: for each concurrency, on then off (then off then on for the
    next), with the same prompts. Results are written to --json-out after each block."""
    res = {"config": vars(a), "machine_before": machine_info(), "cells": []}
    for mode in a.modes:
        for spec in a.specs:
            cfg = argparse.Namespace(**vars(a))
            cfg.compile = mode == "compiled"
            cfg.mtp_k = a.mtp_k if spec == "mtp" else 0
            cfg.buckets = a.concurrency_list
            print(f"== {mode} {spec}: bare forwards, load {os.getloadavg()[0]:.1f}", flush=True)
            b = bare_in_child(cfg)
            servers = {}
            for overlap in (True, False):
                scfg = argparse.Namespace(**vars(cfg))
                scfg.overlap = overlap
                servers[overlap] = TimedServer(scfg)
            try:
                ready = {ov: srv.wait_ready() for ov, srv in servers.items()}
                windows = {}
                for i, c in enumerate(a.concurrency_list):
                    n = max(c, a.requests_per_stream * c)
                    prompts = make_prompts(a, c + n, 100 + c)  # warm-up wave, then measured
                    order = (True, False) if i % 2 == 0 else (False, True)
                    for ov in order:
                        srv = servers[ov]
                        client(srv.port, a, prompts[:c], c)
                        before = srv.state()
                        start, end, tpots = client(srv.port, a, prompts[c:], c)
                        windows[ov, c] = (start, end, tpots, accept_length(before, srv.state()))
                        print(
                            f"   C={c:<3d} overlap {'on ' if ov else 'off'}: TPOT "
                            f"{statistics.median(tpots):.2f} ms, load {os.getloadavg()[0]:.1f}",
                            flush=True,
                        )
            finally:
                records = {ov: srv.stop() for ov, srv in servers.items()}
            for c in a.concurrency_list:
                for ov in (True, False):
                    start, end, tpots, acc = windows[ov, c]
                    cell = {
                        "mode": mode,
                        "spec": spec if spec == "plain" else f"mtp-k{a.mtp_k}",
                        "concurrency": c,
                        "overlap": ov,
                        "bare_ms": b[c]["forward_ms"],
                        "bare": b[c],
                        "compile_s": b["compile_s"],
                        "ready_s": ready[ov],
                        "tpot_ms": round(statistics.median(tpots), 3),
                        "accept_length": acc,
                        **per_step(records[ov], start, end),
                        "parts": breakdown(records[ov], start, end)[0],
                    }
                    res["cells"].append(cell)
            res["machine_after"] = machine_info()
            if a.json_out:
                with open(a.json_out, "w") as f:
                    json.dump(res, f, indent=1, default=str)
    return res


def report_matrix(res: dict) -> None:
    """One row per cell: bare forwards, served step period and its device and host parts,
    TPOT, and the served/bare ratios (step period / bare; device in the step / bare)."""
    print(f"machine before {res['machine_before']}")
    print(f"machine after  {res.get('machine_after')}")
    head = (
        f"{'mode':9s}{'spec':9s}{'C':>3s} {'overlap':8s}{'bare':>8s}{'period':>8s}"
        f"{'device':>8s}{'exposed':>8s}{'host':>8s}{'TPOT':>8s}{'accept':>7s}"
        f"{'step/bare':>10s}{'dev/bare':>9s}"
    )
    print("ms per decode step (medians); bare = the step's forwards back to back, unserved")
    print(head)
    for c in res["cells"]:
        if not c.get("steps"):
            print(f"{c['mode']:9s}{c['spec']:9s}{c['concurrency']:>3d} no steps measured")
            continue
        print(
            f"{c['mode']:9s}{c['spec']:9s}{c['concurrency']:>3d} "
            f"{'on' if c['overlap'] else 'off':8s}{c['bare_ms']:8.2f}{c['period_ms']:8.2f}"
            f"{c['device_ms']:8.2f}{c['host_exposed_ms']:8.2f}{c['host_work_ms']:8.2f}"
            f"{c['tpot_ms']:8.2f}{c['accept_length'] or 1:7.2f}"
            f"{c['period_ms'] / c['bare_ms']:9.2f}x{c['device_ms'] / c['bare_ms']:8.2f}x"
        )


def core_contention(size: int, iters: int) -> dict:
    """ms of a one-thread size x size float32 matmul alone, beside a busy process and beside
    a busy Python thread of this process (medians over iters)."""
    torch.set_num_threads(1)
    x = torch.randn(size, size)

    def matmul_ms() -> float:
        return median_ms(lambda: torch.mm(x, x), iters)

    res = {"alone": matmul_ms()}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        res["beside_process"] = matmul_ms()
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        res["beside_thread"] = matmul_ms()
    finally:
        stop.set()
        th.join()
    print(machine_info())
    print(f"one-thread {size}x{size} matmul, median ms over {iters}:")
    for key, label in (
        ("alone", "alone"),
        ("beside_process", "beside a busy process"),
        ("beside_thread", "beside a busy Python thread"),
    ):
        print(f"  {label:28s} {res[key]:7.2f}   {res[key] / res['alone']:.2f}x")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--compile", action="store_true", help="--enable-torch-compile")
    p.add_argument("--concurrency", type=int, default=1, help="requests at a time")
    p.add_argument("--spec", choices=["plain", "mtp"], default="plain", help="one run's decoder")
    p.add_argument("--mtp-k", type=int, default=1, help="MTP's --speculative-num-steps")
    p.add_argument("--input-len", type=int, help="64; --matrix: 48")
    p.add_argument("--output-len", type=int, help="64; --matrix: 48 (--quick: 32)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--context-length", type=int, help="256; --matrix: 110 (one KV window)")
    p.add_argument("--iters", type=int, help="300; --matrix: 200 (--quick: 50)")
    p.add_argument("--matrix", action="store_true", help="every cell below in one run")
    p.add_argument("--quick", action="store_true", help="--matrix with a smaller workload")
    p.add_argument(
        "--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"]
    )
    p.add_argument("--specs", nargs="+", choices=["plain", "mtp"], default=["plain", "mtp"])
    p.add_argument("--concurrencies", dest="concurrency_list", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--requests-per-stream",
        type=int,
        help="--matrix: measured requests per stream (4; --quick: 2)",
    )
    p.add_argument("--py-spy", metavar="FILE", help="also profile a run; raw samples to FILE")
    p.add_argument("--gil", action="store_true", help="py-spy samples only the GIL holder")
    p.add_argument(
        "--switch-interval", type=float, help="the server's sys.setswitchinterval (s; 0.005)"
    )
    p.add_argument(
        "--server-flags", nargs=argparse.REMAINDER, default=[], help="more server flags (last)"
    )
    p.add_argument("--core-contention", action="store_true", help="the cores check (below)")
    p.add_argument("--size", type=int, default=700, help="--core-contention's matrix size")
    p.add_argument("--json-out")
    a = p.parse_args()
    if a.core_contention:
        res = core_contention(a.size, a.iters or 100)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump({"machine": machine_info(), "ms": res}, f, indent=1)
        return
    a.matrix = a.matrix or a.quick
    defaults = (
        {"input_len": 48, "output_len": 32 if a.quick else 48, "context_length": 110}
        if a.matrix
        else {"input_len": 64, "output_len": 64, "context_length": 256}
    )
    defaults["iters"] = (50 if a.quick else 200) if a.matrix else 300
    defaults["requests_per_stream"] = 2 if a.quick else 4
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.overlap = None  # one run: the default, or --server-flags --{enable,disable}-overlap-...
    if a.matrix:
        if a.py_spy:
            p.error("--py-spy profiles one run, not --matrix")
        report_matrix(matrix(a))
        return
    a.buckets = [a.concurrency]
    a.mtp_k = a.mtp_k if a.spec == "mtp" else 0
    res = {"config": vars(a), "machine_before": machine_info()}
    b = bare_in_child(a)
    res["bare"] = {"compile_s": b["compile_s"], **b[a.concurrency]}
    res["served"] = served(a)
    res["machine_after"] = machine_info()
    report(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)


def report(res: dict) -> None:
    b, s = res["bare"], res["served"]
    print(f"bare decode forward(s)    {b['forward_ms']:8.3f} ms")
    if "least_step_ms" in b:
        print(f"bare least step           {b['least_step_ms']:8.3f} ms")
    if "forward_no_guards_ms" in b:
        print(
            f"bare forward, no guards   {b['forward_no_guards_ms']:8.3f} ms "
            f"(with guards again {b['forward_again_ms']:.3f} ms)"
        )
    print(
        f"served TPOT (median)      {s['tpot_ms']:8.3f} ms   "
        f"TPOT / forward {s['tpot_ms'] / b['forward_ms']:.2f}x"
    )
    print(f"server ready (compiled)   {s['ready_s']} s from launch")
    print(f"scheduler step period     {s['step_period_ms']} ms over {s['decode_steps']} steps")
    if s["step_period_ms"]:
        print(f"step period / forward     {s['step_period_ms'] / b['forward_ms']:.2f}x")
    if s["per_step"].get("steps"):
        ps = s["per_step"]
        print(
            f"per step (medians)        period {ps['period_ms']} ms = device {ps['device_ms']} "
            f"+ host exposed {ps['host_exposed_ms']}; host work {ps['host_work_ms']} ms"
        )
    print("ms per decode step, by thread (median call x calls per step / mean):")
    order = {label: i for i, (label, _, _) in enumerate(PARTS)}
    keys = sorted(s["parts"], key=lambda k: (k.split(" | ")[0], order.get(k.split(" | ")[1], 99)))
    for key in keys:
        thread, label = key.split(" | ")
        ms = s["parts"][key]
        print(f"  {thread:16s} {label:22s} {ms['median_ms']:8.3f} {ms['mean_ms']:8.3f}")
    for thread, frames in (s["py_spy"] or {}).items():
        print(f"py-spy {thread}:")
        for frame, pct in frames.items():
            print(f"  {pct:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
