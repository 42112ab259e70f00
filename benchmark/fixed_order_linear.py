"""Bare-call cost of batch-invariant mode's two CPU bf16 linears, side by side in one run: the
fixed-order kernel (`layers/ops/cpu_bf16`) and oneDNN's prepacked product
(`layers/onednn_packed`), on the shipped checkpoint's layouts, at decode and prefill row counts.
Bare forwards (hot weights, one call repeated), not the served path: `deterministic.py` is that.

    OMP_NUM_THREADS=1 python benchmark/fixed_order_linear.py [--rows 1 16 64 128] [--reps 200]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from srt_ascend.layers import onednn_packed
from srt_ascend.layers.ops import cpu_bf16

# (N, K): q_a+kv_a, q_b, o_proj, one expert's gate/up and down, the dense MLP's down, the
# stacked gate/up of 9 experts, their down projections side by side, the LM head
LAYOUTS = [(208, 256), (384, 128), (256, 256), (512, 256), (256, 256), (256, 768)]
LAYOUTS += [(4608, 256), (256, 2304), (8192, 256)]


def best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    if cpu_bf16.ops() is None:
        raise SystemExit(f"cpu_bf16 unavailable: {cpu_bf16.unavailable()}")
    print(f"cpu_bf16 path {cpu_bf16.path_name()}, {torch.get_num_threads()} thread(s)")
    print("| N x K | rows | cpu_bf16 us | oneDNN packed us | ratio |")
    print("| --- | --- | --- | --- | --- |")
    g = torch.Generator().manual_seed(0)
    for n, k in dict.fromkeys(LAYOUTS):
        w = torch.randn(n, k, generator=g).bfloat16()
        fixed, packed = cpu_bf16.pack(w), onednn_packed.pack(w)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            reps = max(5, args.reps // m)
            a = best_us(partial(cpu_bf16.linear, x, fixed, n), reps)
            b = best_us(partial(onednn_packed.linear, x, packed, None), reps)
            print(f"| {n} x {k} | {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
