"""Serving overhead: the bare decode forward beside the step it serves.

    python benchmark/step_overhead.py [--compile] [--concurrency 1] [--input-len 64]
        [--output-len 64] [--num-prompts 16] [--context-length 256] [--py-spy FILE [--gil]]
        [--switch-interval S] [--json-out FILE] [--server-flags --num-threads 1 ...]

One run, shipped checkpoint, bf16, MTP off, greedy, `--concurrency` C requests at a time:
1. bare: a ModelRunner with the server's settings (graphs at batch C; `--compile`:
   compiled) replays the decode forward (the LM head inside its graph) back to back over C
   requests with KV of the served mean length: the forward alone, and the least a step needs
   (batch build + forward + argmax read); compiled, also the forward without dynamo's guard
   evaluation.
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
`sys.setswitchinterval` (an experiment on GIL hand-offs). The server overlaps decode steps
(the default: "step (overlapped)" is the finish of a launched step, in the loop's thread, and
the forward runs in the device worker's, `srt-scheduler`); `--disable-overlap-schedule`
(after `--server-flags`) times the serial loop ("step (decode)").
"""

from __future__ import annotations

import argparse
import collections
import gc
import http.client
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

from srt_ascend.server_args import SHIPPED_MODEL

# (label, "module:owner", method or None for a module function) of every timed part; the
# label's indent shows nesting.
PARTS = [
    ("step (decode)", "srt_ascend.managers.scheduler:Scheduler", "_run_decode"),
    # overlap scheduling (the default): a decode step is launched, then finished a step later
    ("step (overlapped)", "srt_ascend.managers.scheduler:Scheduler", "_finish_step"),
    ("  launch", "srt_ascend.decoding.plain:PlainDecoder", "launch"),
    ("  finish", "srt_ascend.decoding.plain:PlainDecoder", "finish"),
    ("  kv alloc", "srt_ascend.managers.kv_book:KVBook", "alloc_running"),
    ("  batch build", "srt_ascend.model_executor.model_runner:ModelRunner", "build_forward_batch"),
    ("  forward + logits", "srt_ascend.model_executor.model_runner:ModelRunner", "forward_logits"),
    ("    graph replay", "srt_ascend.model_executor.graph_runner:GraphRunner", "run"),
    ("    eager logits", "srt_ascend.model_executor.model_runner:ModelRunner", "compute_logits"),
    ("  sample + read", "srt_ascend.decoding.base:sample_rows", None),
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
    c = str(a.concurrency)
    flags = ["--context-length", str(a.context_length)]
    flags += ["--max-running-requests", str(max(4, a.concurrency))]
    flags += ["--cuda-graph-bs", c, "--enable-cpu-graph"]
    if a.compile:
        flags += ["--enable-torch-compile", "--torch-compile-max-bs", c]
    return flags + a.server_flags


# ---- bare forward --------------------------------------------------------------------------


@torch.inference_mode()
def bare(a) -> dict:
    """ms of one decode forward (graph replay) and of the least step around it."""
    from srt_ascend.decoding import DecoderHandles
    from srt_ascend.decoding.plain import PlainDecoder
    from srt_ascend.model_executor.forward_batch import ForwardMode
    from srt_ascend.model_executor.model_runner import ModelRunner
    from srt_ascend.platforms import get_platform
    from srt_ascend.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", a.model, *server_flags(a)])
    args = args.for_device("cpu")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    runner = ModelRunner(args, get_platform("cpu"))
    kind = PlainDecoder(args, DecoderHandles(runner, None, None, [])).kind
    prefix = a.input_len + a.output_len // 2  # the served mean KV length
    t0 = time.perf_counter()
    runner.capture_graphs([kind], smallest_kv_window=_pow2_at_least(prefix + 1))
    while runner.compile_next_graph():
        pass
    compile_s = time.perf_counter() - t0
    n = a.concurrency
    rows = runner.req_to_token_pool.alloc(n)
    g = torch.Generator().manual_seed(0)
    pool = runner.kv_pool
    locs = []
    for row in rows:
        slots = runner.allocator.alloc(prefix + 1)
        runner.req_to_token_pool.write([row], [0], slots, [prefix + 1])
        for layer in range(runner.num_layers):
            c = torch.randn(prefix, pool.kv_lora_rank, generator=g)
            k_pe = torch.randn(prefix, pool.qk_rope_head_dim, generator=g)
            pool.set_mla_kv_buffer(layer, slots[:prefix], c, k_pe)
        locs.append(slots[prefix:])
    loc = torch.cat(locs)

    def batch():
        return runner.build_forward_batch(
            ForwardMode.DECODE, [5] * n, rows, [prefix + 1] * n, [1] * n, loc
        )

    fb = batch()

    def forward():  # the graph's LM head included
        runner.forward_logits(fb, kind)

    def least_step():
        _, logits = runner.forward_logits(batch(), kind)
        logits.argmax(dim=-1).tolist()

    out = {"compile_s": round(compile_s, 1)}
    for name, fn in (("forward_ms", forward), ("least_step_ms", least_step)):
        out[name] = median_ms(fn, a.iters)
    if a.compile:  # what dynamo's guards cost a call: measured without them, then with again
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            out["forward_no_guards_ms"] = median_ms(forward, a.iters)
        out["forward_again_ms"] = median_ms(forward, a.iters)
    return out


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


def stream_one(port: int, ids: list[int], n: int) -> list[float]:
    """Arrival times of the SSE chunks that carried new tokens."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times, seen = [], 0
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        got = len(json.loads(line[6:])["output_ids"])
        if got > seen:
            times.append(time.perf_counter())
            seen = got
    conn.close()
    return times


def client(port: int, a, prompts: list[list[int]]) -> tuple[float, float, list[float]]:
    """(wall start, wall end, TPOT ms per request) of `a.concurrency` streams at a time, each
    sending its share of `prompts` one after another."""
    start = time.perf_counter()
    tpots: list[float] = []

    def one_stream(share):
        for ids in share:
            t = stream_one(port, ids, a.output_len)
            tpots.append((t[-1] - t[0]) / (len(t) - 1) * 1e3)

    c = a.concurrency
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


def served(a) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp()
    records_path = os.path.join(tmp, "records.json")
    argv = ["--model-path", a.model, "--port", str(port), "--log-level", "warning"]
    proc = multiprocessing.get_context("spawn").Process(
        target=serve,
        args=([*argv, *server_flags(a)], records_path, a.switch_interval),
    )
    launched = time.perf_counter()
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        ready_s = time.perf_counter() - launched  # every shape compiled (the bare run's cache)
        g = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, 8000, (a.input_len,), generator=g).tolist()
            for _ in range(a.num_prompts + 2 * a.concurrency)
        ]
        warm = 2 * a.concurrency
        client(port, a, prompts[:warm])  # warm-up
        start, end, tpots = client(port, a, prompts[warm:])
        spy = py_spy_profile(proc.pid, port, a, prompts[warm:]) if a.py_spy else None
    finally:
        proc.terminate()
        proc.join(60)
    with open(records_path) as f:
        records = json.load(f)
    shutil.rmtree(tmp)
    parts, counts = breakdown(records, start, end)
    return {
        "tpot_ms": round(statistics.median(tpots), 3),
        "ready_s": round(ready_s, 1),
        **counts,
        "parts": parts,
        "py_spy": spy,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--compile", action="store_true", help="--enable-torch-compile")
    p.add_argument("--concurrency", type=int, default=1, help="requests at a time")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--py-spy", metavar="FILE", help="also profile a run; raw samples to FILE")
    p.add_argument("--gil", action="store_true", help="py-spy samples only the GIL holder")
    p.add_argument(
        "--switch-interval", type=float, help="the server's sys.setswitchinterval (s; 0.005)"
    )
    p.add_argument(
        "--server-flags", nargs=argparse.REMAINDER, default=[], help="more server flags (last)"
    )
    p.add_argument("--json-out")
    a = p.parse_args()
    res = {"config": vars(a), "bare": bare(a)}
    res["served"] = served(a)
    report(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)


def report(res: dict) -> None:
    b, s = res["bare"], res["served"]
    print(f"bare decode forward       {b['forward_ms']:8.3f} ms")
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
