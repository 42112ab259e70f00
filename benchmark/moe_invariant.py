"""Bare MoE-layer forwards in batch-invariant mode (--enable-deterministic-inference): the
ordered path (each expert over the tokens that chose it) against the dense one it replaced
(every expert over every token), side by side in one run. Not a served figure.

    python benchmark/moe_invariant.py [--experts 8 64 256] [--tokens 1 16 256] [--hidden 256]
        [--inter 64] [--repeat 5] [--threads 1]

Per (experts, tokens): a RoutedExperts layer with 6 choices per token (2 with 8 experts, as
the shipped checkpoint), hidden and intermediate sizes as given, bf16, random routing; the best of
`repeat` timings of each path, and dense / ordered (above 1: the ordered path is faster).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from srt_ascend.layers import linear as gemm
from srt_ascend.layers.moe import RoutedExperts


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=64, help="each expert's intermediate size")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gemm.configure(1 << 18, gemm.DETERMINISTIC_ROW_TILE)
    rows = []
    for e in args.experts:
        layer = RoutedExperts(e, args.hidden, args.inter)
        with torch.no_grad():
            layer.w13.normal_(0, 0.05)
            layer.w2.normal_(0, 0.05)
        layer = layer.to(torch.bfloat16).eval()
        k = 2 if e <= 8 else 6
        for t in args.tokens:
            g = torch.Generator().manual_seed(t)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            w = torch.rand(t, k, generator=g)
            x = torch.randn(t, args.hidden, generator=g).to(torch.bfloat16)
            with torch.inference_mode():
                dense = best_ms(partial(layer.forward_dense, x, w, ids), args.repeat)
                ordered = best_ms(partial(layer.forward_ordered, x, w, ids), args.repeat)
            rows.append(
                {
                    "experts": e,
                    "k": k,
                    "tokens": t,
                    "dense_ms": dense,
                    "ordered_ms": ordered,
                    "dense_over_ordered": dense / ordered,
                }
            )
            print(
                f"E={e:4d} k={k} T={t:4d}  dense {dense:8.2f} ms  ordered {ordered:8.2f} ms"
                f"  dense/ordered {dense / ordered:6.2f}x",
                flush=True,
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
