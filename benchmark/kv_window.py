"""Replayed decode step time at a short and a long live KV length, one KV window vs windows.

    python benchmark/kv_window.py [--device auto] [--dtype float32] [--context-length 4096]
        [--kv-lens 128 2048] [--batch-sizes 1 8] [--iters 20] [--threads N] [--json-out FILE]

On the shipped checkpoint, captures the decode graph twice in one run: as before issue 13
(one KV window, the whole req_to_token row: context length + 17) and as now (torch_native
kinds per KV window, `graph_runner.kv_windows`), then replays a decode step of `bs` requests
whose KV length is each of `--kv-lens` through both, beside the eager step. The KV content is
irrelevant to the timing, so requests get slots without a prefill. With a backend that reads
lengths on the device (triton on CUDA) both captures hold one graph per bucket, and the
replay time must follow the live length anyway.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs


def timed(platform, fns: dict, iters: int) -> dict[str, float]:
    """Median milliseconds per call of each function, called in turn within every iteration
    (so that load from elsewhere on a shared machine hits them alike)."""
    samples = {name: [] for name in fns}
    for i in range(iters + 2):  # the first two rounds warm up
        for name, fn in fns.items():
            platform.synchronize()
            t0 = time.perf_counter()
            fn()
            platform.synchronize()
            if i >= 2:
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def decode_batch(runner: ModelRunner, bs: int, kv_len: int):
    """A decode batch of `bs` requests at KV length `kv_len`, with the slots it owns."""
    rows = runner.req_to_token_pool.alloc(bs)
    slots = [runner.allocator.alloc(kv_len) for _ in range(bs)]
    for row, s in zip(rows, slots):
        runner.req_to_token_pool.req_to_token[row, :kv_len] = s
    loc = torch.stack([s[-1] for s in slots])
    fb = runner.build_forward_batch(
        ForwardMode.DECODE, [5] * bs, rows, [kv_len] * bs, [1] * bs, loc
    )
    return fb, rows, slots


@torch.inference_mode()
def measure(runner: ModelRunner, kv_lens, batch_sizes, iters: int) -> list[dict]:
    """Per (bs, KV length): eager, one-window replay and windowed replay times (ms)."""
    platform = runner.platform
    kind = GraphKind("decode", ForwardMode.DECODE, 1, 1, runner.attn_backend)
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runners = {}
    for name, smallest in (("one_window", width), ("windowed", None)):
        if smallest is None:
            runner.capture_graphs([kind])
        else:
            runner.capture_graphs([kind], smallest_kv_window=smallest)
        runners[name] = runner.graph_runner
    rows = []
    for bs in batch_sizes:
        for kv_len in kv_lens:
            fb, req_rows, slots = decode_batch(runner, bs, kv_len)
            fns = {"eager": lambda fb=fb: runner.forward_eager(fb)}
            fns |= {name: lambda gr=gr, fb=fb: gr.replay(fb, kind) for name, gr in runners.items()}
            times = timed(platform, fns, iters)
            row = {"bs": bs, "kv_len": kv_len, **{f"{n}_ms": t for n, t in times.items()}}
            row |= {f"{name}_graphs": len(gr.graphs) for name, gr in runners.items()}
            rows.append(row)
            for s in slots:
                runner.allocator.free(s)
            runner.req_to_token_pool.free(req_rows)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| bs | KV length | eager ms | replay, one window ms | replay, windowed ms | gain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['bs']} | {r['kv_len']} | {r['eager_ms']:.2f} | {r['one_window_ms']:.2f} | "
            f"{r['windowed_ms']:.2f} | {r['one_window_ms'] / r['windowed_ms']:.2f}x |"
        )


def build_runner(model_path, device, dtype, context_length, batch_sizes, backend=None):
    platform = get_platform(device)
    args = ServerArgs(
        model_path=model_path,
        device=platform.name,
        dtype=dtype,
        context_length=context_length,
        max_running_requests=max(batch_sizes),
        max_total_tokens=max(batch_sizes) * (context_length + 32),
        enable_cpu_graph=True,
        cuda_graph_bs=tuple(batch_sizes),
        cuda_graph_max_bs=max(batch_sizes),
        **({"attention_backend": backend} if backend else {}),
    ).for_device(platform.name)
    return ModelRunner(args, platform)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default=None, help="default: the device's")
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--kv-lens", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    runner = build_runner(
        a.model_path, a.device, a.dtype, a.context_length, a.batch_sizes, a.attention_backend
    )
    backend = runner.server_args.attention_backend
    print(f"{runner.platform.name}, {a.dtype}, {backend}, context {a.context_length}")
    rows = measure(runner, a.kv_lens, a.batch_sizes, a.iters)
    print_table(rows)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": runner.platform.name, "backend": backend, "rows": rows}, f)


if __name__ == "__main__":
    main()
