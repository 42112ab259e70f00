"""What the HTTP, tokenizer and detokenizer side costs the scheduler: one process or several?

    python benchmark/process_layout.py [--compile] [--concurrencies 1 16 64] [--rounds 3]
        [--layouts http split engine pipe alone] [--input-len 48] [--output-len 48]
        [--requests-per-stream 2] [--json-out FILE] [--server-flags --num-threads 1 ...]

Shipped checkpoint, bf16, greedy, `ignore_eos`, CPU graphs at every concurrency
(`--context-length 110`: one KV window; `--compile`: compiled, `--torch-compile-max-bs` the
largest concurrency; `--server-flags` last, e.g. `--device cuda` on a lent machine). Every
layout runs the same scheduler (same flags) in spawned child processes of its own, all of
them up at once, and the measured runs interleave: per round and concurrency C, each layout
in turn (the order rotates) gets one warm-up wave of C requests and then
`--requests-per-stream` requests on each of C streams, the same prompts for every layout.
The layouts:
- http: the server as users run it (`launch_server.run`: uvicorn + TokenizerManager on the
  main thread's event loop, the scheduler in threads of the same process); C streaming
  /generate clients in this (the harness's) process.
- split: SGLang's layout for the same streaming /generate path: the HTTP server and the
  TokenizerManager (tokenizing, dispatch, incremental detokenizing, responses) in one
  process, the scheduler (its threads as in the server) in a second one; requests, aborts
  and control messages are pickled over one `multiprocessing` pipe, the scheduler's
  per-step outputs over another (a prototype for measuring: no grammars, TP or
  disaggregation; `SchedulerProxy`). Same clients as http.
- engine: the in-process `Engine` (TokenizerManager on its own event-loop thread: dispatch,
  incremental detokenizing and the response dict per step, as served, but no HTTP), C client
  threads in the child calling `Engine.generate`.
- pipe: the scheduler's outputs pickled over a pipe to a second process, which detokenizes
  them and builds and JSON-encodes a response per output (the output side without HTTP);
  finished requests come back over a second pipe; requests are submitted in-process.
- alone: the scheduler with nothing consuming its outputs (the emit only marks finishes):
  the floor for any layout.
Per layout and C, over the measured requests: the scheduler's decode step period (median,
from one step's start to the next, periods with a prefill left out), its ratio to `alone`'s
in the same round, and tokens/s; each thread's CPU time per decode step
(`/proc/self/task/<tid>/stat`, by thread name: `srt-scheduler` runs the forwards (the device
worker), `srt-scheduler-loop` the scheduler's loop, the event loop is `MainThread` (http;
`http: MainThread` in split) or `srt-engine-loop` (engine); the pipe's consumer process and
this harness's client threads counted apart); and the scheduler's host work per step (its
step calls less the forwards and result waits inside them), wall and CPU: their difference
("off CPU") is time the scheduler's Python was ready but not running, waiting for the GIL or
for the OS to give it a core. On a 2-core machine that is the question: a process split
removes the GIL waits but not the competition for the cores.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import sys
import threading
import time
import urllib.request

from machine import machine_info
from step_overhead import (
    DEVICE_LABELS,
    HOST_LABELS,
    PARTS,
    _resolve,
    breakdown,
    client,
    make_prompts,
    per_step,
)

from srt_ascend.server_args import SHIPPED_MODEL

LAYOUTS = ("http", "split", "engine", "pipe", "alone")
SAMPLING = {"temperature": 0, "ignore_eos": True}


def server_flags(a) -> list[str]:
    buckets = [str(c) for c in a.concurrency_list]
    flags = ["--model-path", a.model, "--context-length", str(a.context_length)]
    flags += ["--max-running-requests", str(max(4, *a.concurrency_list))]
    flags += ["--cuda-graph-bs", *buckets, "--enable-cpu-graph", "--log-level", "warning"]
    if a.compile:
        flags += ["--enable-torch-compile", "--torch-compile-max-bs", str(max(a.concurrency_list))]
    return flags + a.server_flags


# ---- in each layout's process ----------------------------------------------------------------


def install_timers(records: list) -> None:
    """Every part of step_overhead's PARTS wrapped: each call appends (label, thread, start,
    wall s, thread CPU s)."""
    for label, path, attr in PARTS:
        owner, name = _resolve(path)
        target, attr = (owner, name) if attr is None else (getattr(owner, name), attr)
        fn = getattr(target, attr)

        def timed(*args, _fn=fn, _label=label, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _fn(*args, **kw)
            finally:
                records.append(
                    (
                        _label,
                        threading.current_thread().name,
                        t0,
                        time.perf_counter() - t0,
                        time.thread_time() - c0,
                    )
                )

        setattr(target, attr, timed)


def thread_cpu(extra_pids: dict[str, int] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name (threads
    Python does not know, e.g. OpenMP workers, as `os:<comm>`; same names summed), and of
    each process in `extra_pids` by its key."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        name = names.get(int(tid), f"os:{comm}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    for key, pid in (extra_pids or {}).items():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        out[key] = (int(fields[11]) + int(fields[12])) / tick
    return out


def consume(conn, done, tokenizer_path: str) -> None:
    """The pipe layout's second process: incremental detokenizing and a JSON-encoded response
    per output (what the tokenizer manager and detokenizer do per step); finished request
    ids back over `done`."""
    from srt_ascend.managers.detokenizer import DecodeState
    from srt_ascend.managers.tp_ranks import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    states: dict[str, DecodeState] = {}
    while True:
        try:
            outputs = conn.recv()
        except EOFError:  # the scheduler's process ended
            return
        for out in outputs:
            state = states.setdefault(out.rid, DecodeState())
            finished = out.finish_reason is not None
            state.update(tokenizer, out.new_token_ids, finished)
            resp = {
                "text": state.text,
                "output_ids": list(state.output_ids),
                "meta_info": {
                    "id": out.rid,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": out.completion_tokens,
                },
            }
            json.dumps(resp)
            if finished:
                del states[out.rid]
                done.send(out.rid)


class Direct:
    """The `pipe` and `alone` layouts: a TokenizerManager whose scheduler's outputs go to a
    consumer process over a pipe (`pipe`) or only mark finishes (`alone`); requests are
    submitted to the scheduler directly."""

    def __init__(self, args, layout: str) -> None:
        from srt_ascend.managers.tokenizer_manager import TokenizerManager

        self.finished: dict[str, threading.Event] = {}
        self.pids: dict[str, int] = {}
        owner = self

        class Manager(TokenizerManager):
            def _on_outputs(self, outputs) -> None:
                owner.on_outputs(outputs)

        if layout == "pipe":
            ctx = multiprocessing.get_context("spawn")
            recv, self.send = ctx.Pipe(duplex=False)
            done_recv, done_send = ctx.Pipe(duplex=False)
            self.consumer = ctx.Process(
                target=consume, args=(recv, done_send, args.tokenizer), daemon=True
            )
            self.consumer.start()
            self.pids["consumer process"] = self.consumer.pid
            self.done = done_recv
            threading.Thread(target=self._finishes, name="pipe-done", daemon=True).start()
        self.layout = layout
        self.tm = Manager(args)

    def on_outputs(self, outputs) -> None:
        if self.layout == "pipe":
            self.send.send_bytes(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL))
            return
        for out in outputs:
            if out.finish_reason is not None:
                self.finished[out.rid].set()

    def _finishes(self) -> None:
        while True:
            self.finished[pickle.loads(self.done.recv_bytes())].set()

    def generate(self, ids: list[int], n: int) -> None:
        req = self.tm.make_request(ids, {"max_new_tokens": n, **SAMPLING})
        self.finished[req.rid] = done = threading.Event()
        self.tm.scheduler.submit(req)
        done.wait()
        del self.finished[req.rid]


# ---- split: SGLang's process layout for the generate path ------------------------------------


def scheduler_process(argv: list[str], to_sched, from_sched, cmd) -> None:
    """The split layout's scheduler process: a TokenizerManager's scheduler (threads as in
    the server) whose outputs are pickled to the HTTP process (`from_sched`); the messages
    the HTTP process submits arrive on `to_sched` (a reply future is answered back as
    ("reply", key, value)); `cmd` answers "cpu" and "records" as `serve_commands` does."""
    from concurrent.futures import Future

    from srt_ascend.managers.tokenizer_manager import TokenizerManager
    from srt_ascend.server_args import prepare_server_args

    records: list = []
    install_timers(records)
    send_lock = threading.Lock()

    def send(obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            from_sched.send_bytes(data)

    class Manager(TokenizerManager):
        def _on_outputs(self, outputs) -> None:
            send(("out", outputs))

    tm = Manager(prepare_server_args(argv))
    runner = tm.runner
    send(
        (
            "info",
            {
                "vocab_size": runner.vocab_size,
                "context_len": runner.context_len,
                "max_total_tokens": runner.max_total_tokens,
                "eos_ids": tm.scheduler.stop_checker.eos_ids,
            },
        )
    )

    def receive() -> None:
        while True:
            key, msg = pickle.loads(to_sched.recv_bytes())
            if key is not None:
                msg = dataclasses.replace(msg, reply=Future())
                msg.reply.add_done_callback(lambda f, key=key: send(("reply", key, f.result())))
            tm.scheduler.submit(msg)

    threading.Thread(target=receive, name="split-receive", daemon=True).start()
    serve_commands(cmd, records, None, {})


class SchedulerProxy:
    """What the HTTP process's TokenizerManager sees of the scheduler in the other process:
    `submit` pickles the message over a pipe (a reply future stays here, answered when the
    scheduler's process sends its value back)."""

    def __init__(self, conn, eos_ids) -> None:
        self.conn = conn
        self.stop_checker = argparse.Namespace(eos_ids=eos_ids)
        self.replies: dict[int, object] = {}
        self.keys = iter(range(1 << 62))
        self.lock = threading.Lock()

    def submit(self, msg) -> None:
        key = None
        if getattr(msg, "reply", None) is not None:
            key = next(self.keys)
            self.replies[key] = msg.reply
            msg = dataclasses.replace(msg, reply=None)
        if getattr(msg, "grammar", None) is not None:
            raise NotImplementedError("the split layout's benchmark carries no grammars")
        data = pickle.dumps((key, msg), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(data)

    def stop(self) -> None:
        pass


def split_http(args, argv: list[str], conn, records: list) -> None:
    """The split layout's HTTP process (this one): uvicorn + a TokenizerManager whose
    scheduler is a `SchedulerProxy` to a spawned scheduler process; commands as
    `serve_commands`, "cpu" and "records" merged with the scheduler process's."""
    import asyncio
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    from srt_ascend import launch_server
    from srt_ascend.constrained import GrammarBackend, GrammarOptions
    from srt_ascend.managers.tokenizer_manager import TokenizerManager, _max_token_chars
    from srt_ascend.managers.tp_ranks import load_tokenizer
    from srt_ascend.platforms import get_platform

    ctx = multiprocessing.get_context("spawn")
    to_sched_r, to_sched_w = ctx.Pipe(duplex=False)
    from_sched_r, from_sched_w = ctx.Pipe(duplex=False)
    cmd_here, cmd_there = ctx.Pipe()
    proc = ctx.Process(target=scheduler_process, args=(argv, to_sched_r, from_sched_w, cmd_there))
    proc.start()
    kind, info = pickle.loads(from_sched_r.recv_bytes())
    assert kind == "info"
    proxy = SchedulerProxy(to_sched_w, info["eos_ids"])

    class SplitManager(TokenizerManager):
        def __init__(self, server_args) -> None:  # TokenizerManager's, the scheduler remote
            self.platform = get_platform(server_args.device)
            self.args = server_args.for_device(self.platform.name)
            self.tokenizer = load_tokenizer(server_args.tokenizer)
            self.states, self._submissions = {}, {}
            self._submission_ids = itertools.count()
            self.loop: asyncio.AbstractEventLoop | None = None
            self.dist_init = self.ranks = None
            self.scheduler, self.thread = proxy, None
            self.runner = argparse.Namespace(config=None, **info)
            self.context_len = info["context_len"]
            self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
            self.max_text_chars = self.context_len * _max_token_chars(self.tokenizer)
            self.grammars = GrammarBackend(
                self.tokenizer,
                info["vocab_size"],
                info["eos_ids"],
                GrammarOptions.from_args(self.args),
            )
            self.draining = False

        def shutdown(self) -> None:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
            self.grammars.shutdown()

    tm_box: list = []

    def build(server_args):
        tm_box.append(SplitManager(server_args))
        return tm_box[0]

    def outputs() -> None:
        while True:
            msg = pickle.loads(from_sched_r.recv_bytes())
            if msg[0] == "out":
                tm_box[0]._on_outputs(msg[1])
            else:
                fut = proxy.replies.pop(msg[1])
                tm_box[0].loop.call_soon_threadsafe(fut.set_result, msg[2])

    def commands() -> None:
        while True:
            cmd = conn.recv()
            if cmd[0] == "cpu":
                cmd_here.send(cmd)
                there = cmd_here.recv()
                here = thread_cpu()
                conn.send({**{f"http: {k}": v for k, v in here.items()}, **there})
            elif cmd[0] == "records":
                cmd_here.send(cmd)
                there = cmd_here.recv()
                conn.send(there + [r for r in records if cmd[1] <= r[2] <= cmd[2]])
            else:
                cmd_here.send(("stop",))
                conn.send("stopped")
                os._exit(0)

    threading.Thread(target=outputs, name="split-outputs", daemon=True).start()
    threading.Thread(target=commands, name="layout-cmd", daemon=True).start()
    launch_server.build_tokenizer_manager = build
    launch_server.run(args)


def layout_child(layout: str, argv: list[str], conn) -> None:
    """One layout in this (spawned) process, driven by commands over `conn`:
    ("cpu",) -> per-thread CPU; ("run", prompts, C, n) -> (start, end) after C client threads
    ran `prompts` (each stream its share, one request after another; not http);
    ("records", start, end) -> the timer records in [start, end]; ("stop",)."""
    records: list = []
    install_timers(records)
    from srt_ascend.server_args import prepare_server_args

    args = prepare_server_args(argv)
    pids: dict[str, int] = {}
    if layout == "split":
        conn.send("started")
        split_http(args, argv, conn, records)
        return
    if layout == "http":  # the server in the main thread, as launched; commands beside it
        from srt_ascend.launch_server import run

        conn.send("started")
        threading.Thread(
            target=serve_commands, args=(conn, records, None, pids), name="layout-cmd", daemon=True
        ).start()
        run(args)
        return
    if layout == "engine":
        from srt_ascend.entrypoints.engine import Engine

        engine = Engine(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

        def gen(ids, n):
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": n, **SAMPLING})
    else:
        direct = Direct(args, layout)
        gen, pids = direct.generate, direct.pids
    conn.send("ready")
    serve_commands(conn, records, gen, pids)


def serve_commands(conn, records: list, gen, pids: dict[str, int]) -> None:
    while True:
        cmd = conn.recv()
        if cmd[0] == "cpu":
            conn.send(thread_cpu(pids))
        elif cmd[0] == "run":
            _, prompts, c, n = cmd

            def stream(share, n=n):
                for ids in share:
                    gen(ids, n)

            start = time.perf_counter()
            threads = [
                threading.Thread(target=stream, args=(prompts[i::c],), name=f"client-{i}")
                for i in range(c)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            conn.send((start, time.perf_counter()))
        elif cmd[0] == "records":
            conn.send([r for r in records if cmd[1] <= r[2] <= cmd[2]])
        else:
            conn.send("stopped")
            os._exit(0)


# ---- the harness -------------------------------------------------------------------------------


class Layout:
    """One layout's child process (http: also its port)."""

    def __init__(self, name: str, a) -> None:
        self.name = name
        argv = server_flags(a)
        if name in ("http", "split"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.port = sock.getsockname()[1]
            argv += ["--port", str(self.port)]
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=layout_child, args=(name, argv, child))
        self.proc.start()

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def wait_ready(self) -> None:
        self.conn.recv()  # "ready" / "started"
        if self.name not in ("http", "split"):
            return
        url = f"http://127.0.0.1:{self.port}"
        while True:
            if not self.proc.is_alive():
                raise RuntimeError("the http layout's server exited")
            try:
                info = json.load(urllib.request.urlopen(url + "/server_info", timeout=2))
                if info["internal_states"][0].get("torch_compile", {}).get("ready", True):
                    return
            except OSError:
                pass
            time.sleep(1)

    def run(self, a, prompts, c) -> tuple[float, float, float]:
        """(start, end, harness CPU s) of the client run."""
        if self.name in ("http", "split"):
            cpu0 = time.process_time()
            start, end, _ = client(self.port, a, prompts, c)
            return start, end, time.process_time() - cpu0
        start, end = self.ask("run", prompts, c, a.output_len)
        return start, end, 0.0

    def stop(self) -> None:
        try:
            self.ask("stop")
        except (EOFError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def host_wall_cpu(records: list, steps: int) -> tuple[float, float]:
    """ms per decode step of the scheduler's host work (HOST_LABELS calls less the forwards
    and result waits nested in them, on the same thread): wall and thread CPU."""
    idle = [r for r in records if r[0] in DEVICE_LABELS or r[0] == "  wait"]
    idle_starts = [r[2] for r in idle]
    wall = cpu = 0.0
    for label, thread, t0, dt, ct in records:
        if label not in HOST_LABELS:
            continue
        wall += dt
        cpu += ct
        covered = t0
        k = bisect.bisect_left(idle_starts, t0)
        while k < len(idle) and idle[k][2] <= t0 + dt:
            _, th_k, t0_k, dt_k, ct_k = idle[k]
            if th_k == thread and t0_k >= covered and t0_k + dt_k <= t0 + dt:
                wall -= dt_k
                cpu -= ct_k
                covered = t0_k + dt_k
            k += 1
    n = max(steps, 1)
    return round(wall / n * 1e3, 3), round(cpu / n * 1e3, 3)


def measure(layout: Layout, a, prompts, c) -> dict:
    layout.run(a, prompts[:c], c)  # warm-up wave
    cpu0 = layout.ask("cpu")
    start, end, client_cpu = layout.run(a, prompts[c:], c)
    cpu1 = layout.ask("cpu")
    records = layout.ask("records", start, end)
    ps = per_step([r[:4] for r in records], start, end)
    parts = breakdown([r[:4] for r in records], start, end)[0]
    steps = sum(1 for r in records if r[0] in ("step (decode)", "step (overlapped)"))
    host_wall, host_cpu = host_wall_cpu(sorted(records, key=lambda r: r[2]), steps)
    n = max(steps, 1)
    cpu = {k: round((v - cpu0.get(k, 0.0)) / n * 1e3, 3) for k, v in cpu1.items()}
    if client_cpu:
        cpu["harness clients"] = round(client_cpu / n * 1e3, 3)
    tokens = (len(prompts) - c) * a.output_len
    return {
        "layout": layout.name,
        "concurrency": c,
        "decode_steps": steps,
        "wall_s": round(end - start, 3),
        "tokens_per_s": round(tokens / (end - start), 1),
        "period_ms": ps.get("period_ms"),
        "device_ms": ps.get("device_ms"),
        "host_wall_ms": host_wall,
        "host_cpu_ms": host_cpu,
        "host_off_cpu_ms": round(host_wall - host_cpu, 3),
        "cpu_ms_per_step": {k: v for k, v in sorted(cpu.items()) if v > 0},
        "parts": parts,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--compile", action="store_true", help="--enable-torch-compile")
    p.add_argument(
        "--concurrencies", dest="concurrency_list", type=int, nargs="+", default=[1, 16, 64]
    )
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--input-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--context-length", type=int, default=110)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="every cell this many times, interleaved")
    p.add_argument("--json-out")
    p.add_argument(
        "--server-flags", nargs=argparse.REMAINDER, default=[], help="more server flags (last)"
    )
    a = p.parse_args()
    res = {"config": vars(a), "machine_before": machine_info(), "cells": []}
    layouts = [Layout(name, a) for name in a.layouts]
    try:
        for lay in layouts:
            lay.wait_ready()
        print(f"all layouts up, load {os.getloadavg()[0]:.1f}", flush=True)
        turn = 0
        for rnd in range(a.rounds):
            for c in a.concurrency_list:
                prompts = make_prompts(a, c + a.requests_per_stream * c, 100 + c + 1000 * rnd)
                order = layouts[turn % len(layouts) :] + layouts[: turn % len(layouts)]
                turn += 1
                for lay in order:
                    cell = measure(lay, a, prompts, c)
                    cell["round"] = rnd
                    res["cells"].append(cell)
                    print(
                        f"round {rnd} C={c:<3d} {lay.name:7s} period {cell['period_ms']} ms, "
                        f"host wall/cpu "
                        f"{cell['host_wall_ms']}/{cell['host_cpu_ms']} ms, load "
                        f"{cell['load_avg'][0]}",
                        flush=True,
                    )
    finally:
        for lay in layouts:
            lay.stop()
    res["machine_after"] = machine_info()
    res["summary"] = summary(res)
    report(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)


def summary(res: dict) -> list[dict]:
    """Per (C, layout): medians over the rounds of the step period, of its ratio to `alone`'s
    in the same round, tokens/s, the host work's wall / CPU / off-CPU, each thread's CPU per
    step and the event loop's timed parts; the periods' spread (min, max)."""
    cells = res["cells"]
    alone = {
        (c["round"], c["concurrency"]): c["period_ms"] for c in cells if c["layout"] == "alone"
    }
    rows = []
    for conc in sorted({c["concurrency"] for c in cells}):
        for name in LAYOUTS:
            mine = [c for c in cells if c["concurrency"] == conc and c["layout"] == name]
            mine = [c for c in mine if c["period_ms"]]
            if not mine:
                continue

            def med(vals):
                return round(statistics.median(vals), 3) if vals else None

            ratios = [
                c["period_ms"] / alone[c["round"], conc]
                for c in mine
                if alone.get((c["round"], conc))
            ]
            threads = sorted({k for c in mine for k in c["cpu_ms_per_step"]})
            parts = sorted({k for c in mine for k in c["parts"]})
            rows.append(
                {
                    "concurrency": conc,
                    "layout": name,
                    "rounds": len(mine),
                    "period_ms": med([c["period_ms"] for c in mine]),
                    "period_range_ms": [
                        min(c["period_ms"] for c in mine),
                        max(c["period_ms"] for c in mine),
                    ],
                    "period_vs_alone": med(ratios),
                    "tokens_per_s": med([c["tokens_per_s"] for c in mine]),
                    "host_wall_ms": med([c["host_wall_ms"] for c in mine]),
                    "host_cpu_ms": med([c["host_cpu_ms"] for c in mine]),
                    "host_off_cpu_ms": med([c["host_off_cpu_ms"] for c in mine]),
                    "cpu_ms_per_step": {
                        k: med([c["cpu_ms_per_step"].get(k, 0.0) for c in mine]) for k in threads
                    },
                    "parts_ms_per_step": {
                        k: med([c["parts"].get(k, {}).get("mean_ms", 0.0) for c in mine])
                        for k in parts
                    },
                }
            )
    return rows


def report(res: dict) -> None:
    print(f"machine before {res['machine_before']}")
    print(f"machine after  {res['machine_after']}")
    print("medians over the rounds; ms per decode step; /alone: period over alone's, same round")
    print(
        f"{'C':>3s} {'layout':7s}{'period':>8s}{'(min-max)':>16s}{'/alone':>8s}{'tok/s':>8s}"
        f"{'host':>7s}{'hostCPU':>8s}{'offCPU':>7s}  CPU ms per step by thread"
    )
    for r in res["summary"]:
        lo, hi = r["period_range_ms"]
        ratio = f"{r['period_vs_alone']:7.2f}x" if r["period_vs_alone"] else f"{'':8s}"
        threads = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_step"].items() if v >= 0.05)
        print(
            f"{r['concurrency']:>3d} {r['layout']:7s}{r['period_ms']:8.2f}{lo:8.2f}-{hi:7.2f}"
            f"{ratio}{r['tokens_per_s']:8.0f}{r['host_wall_ms']:7.2f}{r['host_cpu_ms']:8.2f}"
            f"{r['host_off_cpu_ms']:7.2f}  {threads}"
        )
    print("the output side's timed parts, ms per step (mean):")
    for r in res["summary"]:
        parts = {
            k: v
            for k, v in r["parts_ms_per_step"].items()
            if k.split(" | ")[1] in ("dispatch", "detokenize", "response", "  emit")
        }
        print(
            f"{r['concurrency']:>3d} {r['layout']:7s} "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
        )


if __name__ == "__main__":
    sys.exit(main())
