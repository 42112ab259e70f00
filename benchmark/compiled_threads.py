"""A compiled decode forward with its OpenMP team on every core vs leaving one core free.

    python benchmark/compiled_threads.py [--rounds 4] [--iters 150] [--json-out FILE]

One process, shipped checkpoint, bf16, MTP off, batch 1, KV of 96 tokens (window 128), the
server's compile settings. Two ModelRunners compile the same decode shape: "every core" with
the old rule (a compiled forward runs with the eager ops' threads, torch's default: one per
core) and "leave a core" with the CPU platform's rule (`compiled_forward_threads`: cores - 1,
at least 1). Bare forwards (graph replay, main thread, back to back), interleaved over
`--rounds`, each timed with the cores otherwise idle and with one busy process beside it
(what the serving process's event loop, tokenizer and the client are to the forward while a
token streams). Prints the median ms per forward of each round and the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from step_overhead import median_ms

from srt_ascend.decoding import DecoderHandles
from srt_ascend.decoding.plain import PlainDecoder
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.cpu import CpuPlatform, usable_cores
from srt_ascend.server_args import SHIPPED_MODEL, prepare_server_args


class EveryCorePlatform(CpuPlatform):
    """The rule before issue 30: compiled forwards take the eager ops' threads."""

    def compiled_forward_threads(self, eager_threads: int) -> int:
        return eager_threads


def build(platform: CpuPlatform):
    """A runner with the decode shape compiled at bucket 1, window 128, and a forward over one
    request with 96 tokens of KV."""
    args = prepare_server_args(
        ["--model-path", SHIPPED_MODEL, "--context-length", "256", "--max-running-requests", "4"]
        + ["--cuda-graph-bs", "1", "--enable-torch-compile", "--torch-compile-max-bs", "1"]
    ).for_device("cpu")
    runner = ModelRunner(args, platform)
    kind = PlainDecoder(args, DecoderHandles(runner, None, None, [])).kind
    runner.capture_graphs([kind], smallest_kv_window=128)
    while runner.compile_next_graph():
        pass
    prefix = 96
    row = runner.req_to_token_pool.alloc(1)[0]
    slots = runner.allocator.alloc(prefix + 1)
    runner.req_to_token_pool.write([row], [0], slots, [prefix + 1])
    loc = slots[prefix:]
    fb = runner.build_forward_batch(ForwardMode.DECODE, [5], [row], [prefix + 1], [1], loc)
    return lambda: runner.forward(fb, kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--json-out")
    a = p.parse_args()
    eager_threads = torch.get_num_threads()
    forwards = {
        "every core": build(EveryCorePlatform()),
        "leave a core": build(CpuPlatform()),
    }
    rows = []
    for r in range(a.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(0.2 if busy else 0)
                for name, fn in forwards.items():
                    with torch.inference_mode():
                        ms = median_ms(fn, a.iters)
                    rows.append({"round": r, "busy": busy, "rule": name, "ms": ms})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    summary = {}
    for busy in (False, True):
        for name in forwards:
            summary[f"{name}, {'one core busy' if busy else 'idle'}"] = [
                x["ms"] for x in rows if x["busy"] == busy and x["rule"] == name
            ]
    print(f"cores {usable_cores()}, eager threads {eager_threads}")
    print("| compiled decode forward (bare, ms per forward, each round's median) | rounds |")
    print("| --- | --- |")
    for k, v in summary.items():
        print(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"cores": usable_cores(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
