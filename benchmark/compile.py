"""Eager vs torch.compile'd forwards side by side, and the MTP speed-up their costs allow.

    python benchmark/compile.py [--k 1 2 3] [--verify fia] [--buckets 1] [--prefix 128]
        [--accept 1.871 2.6 3.142] [--iters 200] [--json-out FILE]

One process, shipped checkpoint, bf16. For each K a ModelRunner captures the MTP decoder's
kinds (decode, verify, draft extend, draft steps) for the given buckets and one KV window
(prefix + K + 1 rounded up to the req_to_token row: what a graph replay gathers), twice:
uncompiled and with --enable-torch-compile (the CPU platform's inductor settings). Every
request has `--prefix` tokens of (random) KV. Per bucket it prints the time of one decode
forward, one (1+K)-token verify, one draft-extend pass and one further draft step, eager
(`forward_eager`: what serving runs without graphs) vs compiled (graph replay), and the
cost model: an MTP step at accept length L emits L tokens for verify + extend + (K-1) steps,
so its speed-up over decoding one token per decode forward is L * decode / step. Accept
lengths default to the held-out bench_serving measurements (benchmark/README.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import MAX_SPEC_STEPS, SHIPPED_MODEL, ServerArgs
from srt_ascend.speculative.mtp_decoder import MTPDecoder

HELDOUT_ACCEPT = {1: 1.871, 2: 2.6, 3: 3.142}


def build(k: int, verify: str, buckets: list[int], prefix: int, compiled: bool) -> ModelRunner:
    args = ServerArgs(
        model_path=SHIPPED_MODEL,
        context_length=prefix + 1,
        max_running_requests=max(buckets),
        max_total_tokens=max(buckets) * (prefix + MAX_SPEC_STEPS + 2),
        speculative_algorithm="MTP",
        speculative_num_steps=k,
        speculative_verify=verify,
        enable_cpu_graph=True,
        enable_torch_compile=compiled,
        torch_compile_max_bs=max(buckets),
        torch_compile_at_start=True,  # capture_s: the whole compile
        cuda_graph_bs=tuple(buckets),
    )
    runner = ModelRunner(args, get_platform("cpu"))
    decoder = MTPDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    width = runner.req_to_token_pool.req_to_token.shape[1]
    t0 = time.perf_counter()
    runner.capture_graphs(decoder.graph_kinds(), smallest_kv_window=width)  # one window
    runner.capture_s = time.perf_counter() - t0
    runner.kinds = {kind.name: kind for kind in decoder.graph_kinds()}
    return runner


def batches(runner: ModelRunner, k: int, bs: int, prefix: int):
    """(name, kind, ForwardBatch, hidden or None) per kind for `bs` requests of `prefix`
    tokens of random KV, each with its next 1+K positions' slots."""
    g = torch.Generator().manual_seed(0)
    rows = runner.req_to_token_pool.alloc(bs)
    width = prefix + k + 1
    slots = runner.allocator.alloc(bs * width).view(bs, width)
    for row, s in zip(rows, slots):
        runner.req_to_token_pool.req_to_token[row, :width] = s
    pool = runner.kv_pool
    for layer in range(runner.num_layers):
        loc = slots[:, :prefix].flatten()
        c = torch.randn(len(loc), pool.kv_lora_rank, generator=g)
        pool.set_mla_kv_buffer(layer, loc, c, torch.randn(len(loc), pool.qk_rope_head_dim))
    hid = runner.config.hidden_size
    out = []
    for name, kind in runner.kinds.items():
        q = kind.tokens_per_req
        ids = torch.randint(3, runner.vocab_size, (bs * q,), generator=g)
        loc = slots[:, prefix : prefix + q].flatten()
        if kind.rows_per_req > 1:  # batch expansion: q single-token rows per request
            r = [row for row in rows for _ in range(q)]
            seqs = [prefix + j + 1 for _ in rows for j in range(q)]
            fb = runner.build_forward_batch(
                kind.mode, ids, r, seqs, [1] * len(r), loc, kind.backend
            )
        else:
            fb = runner.build_forward_batch(
                kind.mode, ids, rows, [prefix + q] * bs, [q] * bs, loc, kind.backend
            )
        hidden = torch.randn(bs * q, hid, generator=g).to(runner.dtype)
        hidden = hidden if kind.mtp_layer is not None else None
        out.append((name, kind, fb, hidden))
    return out


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def forward_costs(runner: ModelRunner, k: int, bs: int, prefix: int, iters: int, compiled: bool):
    """ms per forward of each kind: graph replay when compiled, else forward_eager."""
    costs = {}
    with torch.inference_mode():
        for name, kind, fb, hidden in batches(runner, k, bs, prefix):
            if compiled:
                run = lambda f=fb, g=kind, h=hidden: runner.graph_runner.replay(f, g, h)  # noqa: E731
            else:
                run = lambda f=fb, g=kind, h=hidden: runner.forward_eager(f, g.mtp_layer, h)  # noqa: E731
            costs[name] = timed(run, iters)
    return costs


def step_model(costs: dict, k: int, accept: float) -> dict:
    verify = next(v for n, v in costs.items() if n.startswith("verify"))
    steps = [v for n, v in costs.items() if n.startswith("draft_step")]
    step = verify + costs["draft_extend"] + (k - 1) * (steps[0] if steps else 0.0)
    return {"mtp_step_ms": step, "allowed_speedup": accept * costs["decode"] / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--verify", default="fia", choices=["fia", "expand"])
    p.add_argument("--buckets", type=int, nargs="+", default=[1])
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--accept", type=float, nargs="+", default=None)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    accept = dict(zip(a.k, a.accept)) if a.accept else HELDOUT_ACCEPT
    rows = []
    for k in a.k:
        for compiled in (False, True):
            runner = build(k, a.verify, a.buckets, a.prefix, compiled)
            for bs in a.buckets:
                costs = forward_costs(runner, k, bs, a.prefix, a.iters, compiled)
                row = {"k": k, "bucket": bs, "compiled": compiled, "capture_s": runner.capture_s}
                rows.append({**row, **costs, **step_model(costs, k, accept[k])})
                print(json.dumps(rows[-1]), flush=True)
    print(
        "| K | bucket | forwards | decode ms | verify ms | draft extend ms | draft step ms "
        "| MTP step ms | allowed speed-up (L * decode / step) | capture s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        verify = next(v for n, v in r.items() if n.startswith("verify"))
        step = next((v for n, v in r.items() if n.startswith("draft_step")), None)
        print(
            f"| {r['k']} | {r['bucket']} | {'compiled' if r['compiled'] else 'eager'} "
            f"| {r['decode']:.2f} | {verify:.2f} | {r['draft_extend']:.2f} "
            f"| {'-' if step is None else f'{step:.2f}'} | {r['mtp_step_ms']:.2f} "
            f"| {r['allowed_speedup']:.2f}x (L = {accept[r['k']]}) | {r['capture_s']:.0f} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
