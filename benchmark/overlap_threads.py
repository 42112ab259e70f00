"""Does a decode forward on the device worker's thread overlap the scheduler's Python (CPU)?

    python benchmark/overlap_threads.py [--threads 1 2] [--host-ms 1.0] [--batch 1 16]
        [--switch-interval 0.005 0.0005] [--rounds 5] [--iters 100] [--dtype bfloat16]
        [--json-out FILE]

Shipped checkpoint, eager decode forward (+ logits + argmax) at batch B with KV of 96
positions per request, in one process, each ms figure a median over `--iters` rounds:
- forward: the forward alone, in the thread that loaded the model;
- host: `--host-ms` of pure Python (a stand-in for commit, stop checks, emit and the next
  batch's preparation: it holds the GIL throughout, as that code does);
- serial: forward then host work, in one thread (`--disable-overlap-schedule`);
- overlapped: the forward submitted to a ThreadWorker served by the loading thread while
  another thread runs the host work, then waits for the forward (the overlap scheduler).
`overlapped / serial` < 1 means the overlap gains; the least possible is
max(forward, host) / (forward + host). Eager ops release the GIL only inside their kernels,
so the forward's Python between ops waits for the host thread's GIL (up to the switch
interval) and the host work waits for the forward's: `--switch-interval` sets
`sys.setswitchinterval`. The rounds interleave every setting (this VM's speed drifts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch
from step_overhead import median_ms

from srt_ascend.server_args import SHIPPED_MODEL


def build(dtype: str, batch: int):
    """A ModelRunner and a decode closure over `batch` requests with 96 positions of KV."""
    from srt_ascend.model_executor.forward_batch import ForwardMode
    from srt_ascend.model_executor.model_runner import ModelRunner
    from srt_ascend.platforms import get_platform
    from srt_ascend.server_args import ServerArgs

    args = ServerArgs(model_path=SHIPPED_MODEL, dtype=dtype, max_total_tokens=8192)
    runner = ModelRunner(args, get_platform("cpu"))
    prefix = 96
    rows = runner.req_to_token_pool.alloc(batch)
    slots = runner.allocator.alloc(batch * (prefix + 1)).view(batch, prefix + 1)
    for row, s in zip(rows, slots):
        runner.req_to_token_pool.write([row], [0], s, [prefix + 1])
    loc = slots[:, prefix].contiguous()

    @torch.inference_mode()
    def decode():
        fb = runner.build_forward_batch(
            ForwardMode.DECODE, [5] * batch, rows, [prefix + 1] * batch, [1] * batch, loc
        )
        return runner.compute_logits(runner.forward(fb)).argmax(dim=-1)

    return decode


def host_work(ms: float) -> None:
    """Pure Python for about `ms` (holds the GIL, as the scheduler's commit path does)."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        for i in range(50):
            x += i * i


def measure(decode, host_ms: float, iters: int, worker) -> dict:
    """Called in the loop's thread; every forward runs on the worker (the loading thread),
    and every figure includes one hand-off to it and back."""

    def serial():
        worker.run(lambda: (decode().tolist(), host_work(host_ms)))

    def overlapped():
        done = worker.submit(decode)
        host_work(host_ms)
        done.result().tolist()

    return {
        "forward_ms": median_ms(lambda: worker.run(lambda: decode().tolist()), iters),
        "host_ms": median_ms(lambda: host_work(host_ms), iters),
        "serial_ms": median_ms(serial, iters),
        "overlapped_ms": median_ms(overlapped, iters),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--host-ms", type=float, default=1.0)
    p.add_argument("--switch-interval", type=float, nargs="+", default=[0.005, 0.0005])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json-out")
    a = p.parse_args()
    from srt_ascend.platforms.device_worker import ThreadWorker

    decodes = {b: build(a.dtype, b) for b in a.batch}
    # the forwards run in this (the loading) thread: it serves the worker; the "scheduler"
    # thread runs the host work
    worker = ThreadWorker()
    worker.claim()
    results: dict = {}

    def rounds():
        for _ in range(a.rounds):
            for threads in a.threads:
                for b in a.batch:
                    for si in a.switch_interval:
                        # set in the serving thread, where torch's intra-op pool lives
                        worker.run(lambda t=threads: torch.set_num_threads(t))
                        sys.setswitchinterval(si)
                        r = measure(decodes[b], a.host_ms, a.iters, worker)
                        key = f"threads={threads} batch={b} switch={si}"
                        results.setdefault(key, []).append(r)
        worker.close()

    driver = threading.Thread(target=rounds)
    driver.start()
    worker.serve()
    driver.join()
    summary = {}
    for key, runs in results.items():
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        med["overlapped/serial"] = round(med["overlapped_ms"] / med["serial_ms"], 3)
        best = max(med["forward_ms"], med["host_ms"]) / (med["forward_ms"] + med["host_ms"])
        med["least_possible"] = round(best, 3)
        summary[key] = med
        print(key, json.dumps(med))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": vars(a), "summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
