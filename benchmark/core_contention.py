"""Whether this machine's cores run independently: a one-thread matmul alone, beside a busy
process, and beside a busy Python thread of its own process.

    python benchmark/core_contention.py [--size 700] [--iters 100]

Overlap scheduling on CPU runs the scheduler's host work beside the forward on another core;
it can only hide that work if a second busy core leaves the first one's speed alone. On some
virtual machines two vCPUs share one physical core's capacity (SMT siblings, or an
oversubscribed host), and then anything running beside a forward slows it, whatever the
software does. Prints ms per matmul and the ratios to alone (1.0x: independent cores), with
the CPU model, its flags of note and the load average; compare only within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch


def cpu_facts() -> str:
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    of_note = sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "avx2"})
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(of_note)}; load {os.getloadavg()[0]:.2f}"


def matmul_ms(a: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        torch.mm(a, a)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.mm(a, a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=700)
    p.add_argument("--iters", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(a.size, a.size)
    alone = matmul_ms(x, a.iters)

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        beside_process = matmul_ms(x, a.iters)
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
        beside_thread = matmul_ms(x, a.iters)
    finally:
        stop.set()
        th.join()

    print(cpu_facts())
    print(f"one-thread {a.size}x{a.size} matmul, median ms over {a.iters}:")
    print(f"  alone                        {alone:7.2f}")
    print(f"  beside a busy process        {beside_process:7.2f}   {beside_process / alone:.2f}x")
    print(f"  beside a busy Python thread  {beside_thread:7.2f}   {beside_thread / alone:.2f}x")


if __name__ == "__main__":
    main()
