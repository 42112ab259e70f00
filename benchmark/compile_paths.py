"""The compiled decode forward two ways, side by side: an AOTInductor package (what a start
with the compile cache runs on CPU, weights as inputs) vs torch.compile with frozen weights
(what ran before packages, and still runs where a forward cannot be packaged).

    python benchmark/compile_paths.py [--context-length 100] [--prefix 64] [--iters 100]
        [--rounds 4] [--json-out FILE]

One process, shipped checkpoint, bf16, plain decoding at bucket 1, one KV window. Two model
runners over the same $TORCHINDUCTOR_CACHE_DIR (the packaged one loads its package when a
run before wrote it): seconds each took to capture its compiled graph, then `--rounds`
interleaved rounds of `--iters` back-to-back replays of each (bare forwards in the main
thread, LM head included, over `--prefix` tokens of the same random KV), the median ms per
replay of each arm, and whether both give the same greedy token and how far their logits
differ (inductor's kernels differ: not bit-equal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.decoding.plain import PlainDecoder
from srt_ascend.model_executor import compile_packages
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.cpu import CpuPlatform
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs


class TorchCompilePlatform(CpuPlatform):
    """The CPU platform without packages: every shape through torch.compile (frozen)."""

    package_options = None


def build(platform, context_length: int) -> tuple[ModelRunner, float]:
    args = ServerArgs(
        model_path=SHIPPED_MODEL,
        context_length=context_length,
        max_running_requests=1,
        cuda_graph_bs=(1,),
        enable_torch_compile=True,
        torch_compile_max_bs=1,
        torch_compile_at_start=True,
    )
    runner = ModelRunner(args, platform)
    decoder = PlainDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    t0 = time.perf_counter()
    runner.capture_graphs(decoder.graph_kinds())
    return runner, time.perf_counter() - t0


def prepare(runner: ModelRunner, prefix: int):
    """The decode graph after the batch of one request with `prefix` tokens of seeded KV
    was written into its static buffers: a replay function."""
    gr = runner.graph_runner
    (shape,) = gr.graphs
    g = torch.Generator().manual_seed(0)
    for layer in runner.kv_pool._joint:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    gr.req_to_token_pool.req_to_token[1, : prefix + 1] = torch.arange(1, prefix + 2)
    gr.buf.req_pool_indices[0], gr.buf.seq_lens[0] = 1, prefix + 1
    gr.buf.positions[0], gr.buf.out_cache_loc[0], gr.buf.input_ids[0] = prefix, prefix + 1, 5
    graph = gr.graphs[shape].graph
    return lambda: graph.replay()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context-length", type=int, default=100)
    p.add_argument("--prefix", type=int, default=64)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    arms = {}
    for name, platform in (("package", CpuPlatform()), ("torch.compile", TorchCompilePlatform())):
        compile_packages.stats.clear()
        runner, capture_s = build(platform, a.context_length)
        arms[name] = {
            "runner": runner,
            "capture_s": round(capture_s, 1),
            "packages": dict(compile_packages.stats),
        }
        print(name, json.dumps({k: v for k, v in arms[name].items() if k != "runner"}))
    runs = {name: prepare(arm["runner"], a.prefix) for name, arm in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        outs = {name: run() for name, run in runs.items()}
        for _ in range(a.rounds):
            for name, run in runs.items():
                for _ in range(5):
                    run()
                for _ in range(a.iters):
                    t0 = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - t0) * 1e3)
    logits = {name: out[1] for name, out in outs.items()}
    pkg, tc = logits["package"], logits["torch.compile"]
    result = {
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "threads": torch.get_num_threads(),
        "same_greedy_token": bool(torch.equal(pkg.argmax(-1), tc.argmax(-1))),
        "logits_max_abs_diff": (pkg - tc).abs().max().item(),
        "arms": {
            name: {
                "capture_s": arm["capture_s"],
                "packages": arm["packages"],
                "replay_ms_median": round(statistics.median(times[name]), 3),
                "replay_ms_p10": round(statistics.quantiles(times[name], n=10)[0], 3),
            }
            for name, arm in arms.items()
        },
    }
    print(json.dumps(result, indent=1))
    print("| compiled forward | capture s | replay ms (median) | replay ms (p10) |")
    print("| --- | --- | --- | --- |")
    for name, r in result["arms"].items():
        print(f"| {name} | {r['capture_s']} | {r['replay_ms_median']} | {r['replay_ms_p10']} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), **result}, f, indent=1)


if __name__ == "__main__":
    main()
