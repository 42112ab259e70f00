"""Serving overhead: the bare decode forward beside the step it serves.

    python benchmark/step_overhead.py --matrix [--quick] [--modes eager compiled]
        [--specs plain mtp] [--mtp-k 1] [--concurrencies 1 16] [--temperature T]
        [--json-out FILE]
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

One run (without --matrix), shipped checkpoint, bf16, greedy (`--temperature`: sampled, the
round graph's sampled variant and plain decoding's `decode_sampled`), `--concurrency` C
requests at a time, MTP off (`--spec mtp`: K = --mtp-k):
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

Code: this entry (the matrix, reports, the cores check); `step_bare.py` the bare forward;
`step_served.py` the timed server, clients and the per-step accounting (`per_step`: wall and
CPU time).

`--core-contention`: whether this machine's cores run independently, which decides whether
overlap can hide host work at all: a one-thread `--size` square float32 matmul alone, beside a
busy process, and beside a busy Python thread of its own process (median ms over `--iters`,
the ratios to alone: 1.0x means independent cores; on a VM whose two vCPUs share one core's
capacity anything beside a forward slows it). Run it first on a new host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
from machine import machine_info
from step_bare import bare_in_child, median_ms
from step_served import (
    PARTS,
    TimedServer,
    accept_length,
    breakdown,
    client,
    make_prompts,
    per_step,
    served,
)

from srt_ascend.server_args import SHIPPED_MODEL

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
                        "bare_cpu_ms": b[c].get("forward_cpu_ms"),
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
    TPOT, and the served/bare ratios (step period, device in the step, and host work per
    step, each over bare: issue 43 asks host / bare <= 0.15)."""
    print(f"machine before {res['machine_before']}")
    print(f"machine after  {res.get('machine_after')}")
    head = (
        f"{'mode':9s}{'spec':9s}{'C':>3s} {'overlap':8s}{'bare':>8s}{'period':>8s}"
        f"{'device':>8s}{'exposed':>8s}{'host':>8s}{'TPOT':>8s}{'accept':>7s}"
        f"{'step/bare':>10s}{'dev/bare':>9s}{'host/bare':>10s}{'cpu: host/bare':>15s}"
    )
    print("ms per decode step (medians); bare = the step's forwards back to back, unserved;")
    print("cpu: host / bare = the same ratio in CPU time (host work's threads, bare forward's)")
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
            f"{c['host_work_ms'] / c['bare_ms']:9.3f}x"
            f"{c['host_cpu_ms'] / c['bare_cpu_ms']:14.3f}x"
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
    p.add_argument(
        "--temperature", type=float, default=0.0, help="the clients' sampling (0: greedy)"
    )
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
            f"+ host exposed {ps['host_exposed_ms']}; host work {ps['host_work_ms']} ms "
            f"({ps['host_cpu_ms']} ms CPU; bare forward {b['forward_cpu_ms']} ms CPU)"
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
