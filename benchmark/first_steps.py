"""The first decode steps after a start: an Engine streams one request right after it is
constructed, and every step's time (the gap between two streamed tokens) is recorded.

    python benchmark/first_steps.py [--model-path DIR] [--dtype bfloat16] [--tokens 200]
        [--input-len 128] [--json-out FILE]

Prints the Engine's start time, the CPU seconds the grammar compiler's child process used
while the request ran (its xgrammar import, when the Engine returned before it was done), and
the step times in blocks of 20 (median, max) with the count of steps over 15 ms. A start whose
background work still runs when the Engine returns shows here as a slow first block; the
steady state is the last blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import time

import torch
from machine import machine_info

from srt_ascend import Engine
from srt_ascend.server_args import SHIPPED_MODEL


async def _stream(tm, ids: list[int], tokens: int) -> list[float]:
    req = tm.make_request(
        ids, {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, stream=True
    )
    stamps, seen = [], 0
    async for out in tm.generate_one(req):
        now = time.perf_counter()
        n = len(out["output_ids"])
        stamps += [now] * (n - seen)
        seen = n
    return stamps


def grammar_child_cpu() -> float:
    """CPU seconds (user + system) this process's grammar-compiler children have used."""
    total = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        for pid in open(path).read().split():
            try:
                if b"compile_child" not in open(f"/proc/{pid}/cmdline", "rb").read():
                    continue
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
            except FileNotFoundError:
                pass
    return total / os.sysconf("SC_CLK_TCK")


def first_steps(model_path: str, dtype: str, tokens: int, input_len: int) -> dict:
    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, dtype=dtype)
    start_s = time.perf_counter() - t0
    child_at_ready = grammar_child_cpu()
    try:
        vocab = engine.tokenizer_manager.runner.vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (input_len,), generator=g).tolist()
        fut = asyncio.run_coroutine_threadsafe(
            _stream(engine.tokenizer_manager, ids, tokens), engine.loop
        )
        stamps = fut.result()
        child_while_serving = grammar_child_cpu() - child_at_ready
    finally:
        engine.shutdown()
    steps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]  # ms; the first is prefill
    return {"start_s": start_s, "child_cpu_s_while_serving": child_while_serving, "steps_ms": steps}


def blocks(steps: list[float], size: int = 20) -> list[dict]:
    return [
        {
            "steps": f"{i + 1}-{i + len(b)}",
            "median_ms": round(statistics.median(b), 2),
            "max_ms": round(max(b), 2),
            "over_15ms": sum(s > 15 for s in b),
        }
        for i in range(0, len(steps), size)
        for b in [steps[i : i + size]]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=SHIPPED_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    before = machine_info()
    res = first_steps(a.model_path, a.dtype, a.tokens, a.input_len)
    res["blocks"] = blocks(res["steps_ms"])
    res["machine"] = {**before, "load_avg_after": machine_info()["load_avg"]}
    print(
        f"start {res['start_s']:.1f} s; grammar child CPU while serving "
        f"{res['child_cpu_s_while_serving']:.2f} s; load {before['load_avg']}"
    )
    for b in res["blocks"]:
        print(
            f"steps {b['steps']:>8}: median {b['median_ms']:6.2f} ms  max {b['max_ms']:7.2f}"
            f"  >15 ms: {b['over_15ms']}"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
