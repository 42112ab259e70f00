"""CPU bf16 GEMMs: oneDNN (PyTorch's default for bf16) vs MKL, side by side, process-wide (the
engines run with `--cpu-small-gemm off`, so the global switch alone decides; the runtime's
own per-matmul choice is `--cpu-small-gemm`, layers/linear.py).

    python benchmark/cpu_gemm.py [--rows 1 2 4 8] [--rounds 4] [--output-len 128]
        [--json-out FILE]

1. Whole decoding, one request at a time on held-out prompts, greedy, MTP off and MTP K=1
   (batch expansion): each round starts each engine once and decodes with the process-wide
   oneDNN switch on, then off, so the VM's drift hits all four alike. Reports ms per output
   token under each backend and the K=1 speed-up over MTP off under each.
2. Per GEMM shape of the shipped checkpoint (linear layers and the absorbed-MLA / dense-MoE
   batched matmuls), with `rows` token rows: microseconds per call with oneDNN enabled and
   disabled (`torch.backends.mkldnn`; disabled, bf16 matmuls go to MKL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from spec_decode import prompts as heldout_prompts

from srt_ascend import Engine
from srt_ascend.models.loader import load_config
from srt_ascend.server_args import SHIPPED_MODEL


def gemm_shapes(cfg) -> dict[str, tuple]:
    """name -> ("linear", N, K) or ("bmm", batch, K, N) for one decoder layer, MTP, LM head."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    e = cfg.n_routed_experts + 1  # + the stacked shared expert
    inter = cfg.moe_intermediate_size
    return {
        "q_a+kv_a": ("linear", cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        "q_b": ("linear", heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
        "w_kc (bmm)": ("bmm", heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
        "w_vc (bmm)": ("bmm", heads, cfg.kv_lora_rank, cfg.v_head_dim),
        "o_proj": ("linear", h, heads * cfg.v_head_dim),
        "expert gate+up": ("linear", 2 * inter, h),
        "expert down": ("linear", h, inter),
        "dense MoE gate+up": ("linear", e * 2 * inter, h),
        "dense MoE down (bmm)": ("bmm", e, inter, h),
        "eh_proj": ("linear", h, 2 * h),
        "lm_head": ("linear", cfg.vocab_size, h),
    }


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def shape_table(cfg, rows: list[int]) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, spec in gemm_shapes(cfg).items():
        for m in rows:
            if spec[0] == "linear":
                _, n, k = spec
                x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
                x, w = x.bfloat16(), w.bfloat16()
                fn = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
            else:
                _, b, k, n = spec
                x = torch.randn(b, m, k, generator=gen).bfloat16()
                w = torch.randn(b, k, n, generator=gen).bfloat16()
                fn = lambda x=x, w=w: torch.bmm(x, w)  # noqa: E731
            times = {}
            for onednn in (True, False):
                with torch.backends.mkldnn.flags(enabled=onednn):
                    times[onednn] = per_call_us(fn)
            out.append(
                dict(
                    gemm=name,
                    rows=m,
                    onednn_us=round(times[True], 1),
                    mkl_us=round(times[False], 1),
                )
            )
    return out


def decode_ms_per_token(engine, prompts, params) -> float:
    t0 = time.perf_counter()
    n = 0
    for p in prompts:
        n += len(engine.generate(p, params)["output_ids"])
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    prompts = heldout_prompts(a.prompts)
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    configs = {
        "off": {},
        "mtp-k1-expand": dict(
            speculative_algorithm="MTP", speculative_num_steps=1, speculative_verify="expand"
        ),
    }
    times = {(name, onednn): [] for name in configs for onednn in (True, False)}
    try:
        for _ in range(a.rounds):  # one engine at a time (one OpenMP team), both backends each
            for name, kw in configs.items():
                engine = Engine(model_path=a.model_path, cpu_small_gemm="off", **kw)
                try:
                    engine.generate(prompts[0], {**params, "max_new_tokens": 4})
                    for onednn in (True, False):
                        torch.backends.mkldnn.set_flags(onednn)  # process-wide: the scheduler too
                        times[name, onednn].append(decode_ms_per_token(engine, prompts, params))
                finally:
                    torch.backends.mkldnn.set_flags(True)
                    engine.shutdown()
    finally:
        torch.backends.mkldnn.set_flags(True)
    med = {key: statistics.median(v) for key, v in times.items()}
    whole = [
        dict(
            backend="oneDNN" if onednn else "MKL",
            off_ms_per_token=round(med["off", onednn], 2),
            mtp_k1_ms_per_token=round(med["mtp-k1-expand", onednn], 2),
            mtp_k1_speedup=round(med["off", onednn] / med["mtp-k1-expand", onednn], 3),
            runs_off=[round(v, 2) for v in times["off", onednn]],
            runs_mtp_k1=[round(v, 2) for v in times["mtp-k1-expand", onednn]],
        )
        for onednn in (True, False)
    ]
    print("\n| bf16 GEMMs | MTP off ms/token | MTP K=1 ms/token | K=1 speed-up |")
    print("| --- | --- | --- | --- |")
    for r in whole:
        print(
            f"| {r['backend']} | {r['off_ms_per_token']} | {r['mtp_k1_ms_per_token']} | "
            f"{r['mtp_k1_speedup']}x |"
        )
    # After the engines: GEMMs in this thread start an OpenMP team of its own, which would
    # slow the schedulers' (see README, Design).
    shapes = shape_table(load_config(a.model_path), a.rows)
    print("\n| GEMM | rows | oneDNN us | MKL us |\n| --- | --- | --- | --- |")
    for r in shapes:
        print(f"| {r['gemm']} | {r['rows']} | {r['onednn_us']} | {r['mkl_us']} |")

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(dict(shapes=shapes, decoding=whole), f, indent=1)


if __name__ == "__main__":
    main()
