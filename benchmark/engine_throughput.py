"""Offline throughput of the engine vs transformers, and radix cache on vs off, in one run.

    python benchmark/engine_throughput.py [--model-path DIR] [--dtype bfloat16]
        [--batch-sizes 1 8 32] [--input-len 128] [--output-len 128] [--hf-requests 4]
        [--json-out FILE]

1. Engine: B concurrent requests of `input-len` random token ids, `output-len` greedy tokens
   each (ignore_eos), for each B; tokens/s = generated tokens / wall time.
2. transformers: the same weights through DeepseekV3ForCausalLM.generate, one request at a
   time (greedy, min_new_tokens = max_new_tokens), `hf-requests` requests; tokens/s.
3. Shared prefix: 32 requests = one long common prompt + a short unique suffix, radix cache on
   vs off (each engine warmed with one request of the prefix first).
Ratios are printed side by side (this machine is noisy: compare within one run). The engines
run with their default threads (a CPU rank leaves a core: `engine_threads`); transformers runs
with torch's default count in this thread (`threads`), its best on an otherwise idle machine.
"""

from __future__ import annotations

import json
import os
import time

import torch
from workload_args import random_prompts, workload_parser

from srt_ascend import Engine


def engine_tps(model_path, dtype, prompts, output_len, **kw) -> tuple[float, float]:
    engine = Engine(model_path=model_path, dtype=dtype, **kw)
    try:
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        # warm-up: one whole request (until session 15 the first seconds after a start also
        # paid the grammar compiler child's imports on the other core: benchmark/README.md)
        engine.generate(input_ids=prompts[0], sampling_params=params)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        return sum(len(o["output_ids"]) for o in outs) / wall, wall
    finally:
        engine.shutdown()


def hf_tps(model_path, dtype, prompts, output_len) -> float:
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP layer's weights are unused by transformers
    model = DeepseekV3ForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    n_tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=2,
            )
            n_tokens += out.shape[1] - len(p)
    return n_tokens / (time.perf_counter() - t0)


def shared_prefix(model_path, dtype, disable_radix: bool, prefix_len=1024, n=32, out=16) -> float:
    prefix = random_prompts(1, prefix_len, 8000, seed=7)[0]
    suffixes = random_prompts(n, 16, 8000, seed=8)
    engine = Engine(model_path=model_path, dtype=dtype, disable_radix_cache=disable_radix)
    try:
        params = {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prefix + [5], sampling_params=params)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[prefix + s for s in suffixes], sampling_params=params)
        return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)
    finally:
        engine.shutdown()


def main() -> None:
    p = workload_parser(__doc__)
    p.add_argument("--hf-requests", type=int, default=4)
    a = p.parse_args()
    res: dict = {
        "model": os.path.basename(a.model_path),
        "dtype": a.dtype,
        "threads": torch.get_num_threads(),
    }
    vocab = 8000
    probe = Engine(model_path=a.model_path, dtype=a.dtype)
    res["engine_threads"] = probe.get_internal_state()["intra_op_threads"]
    probe.shutdown()
    for b in a.batch_sizes:
        tps, wall = engine_tps(
            a.model_path, a.dtype, random_prompts(b, a.input_len, vocab, b), a.output_len
        )
        res[f"engine_bs{b}_tok_s"] = round(tps, 1)
        print(f"engine  batch {b:>3}: {tps:8.1f} tok/s  ({wall:.1f} s)", flush=True)
    on = shared_prefix(a.model_path, a.dtype, disable_radix=False)
    off = shared_prefix(a.model_path, a.dtype, disable_radix=True)
    res.update(
        shared_prefix_radix_on_tok_s=round(on, 1),
        shared_prefix_radix_off_tok_s=round(off, 1),
        shared_prefix_ratio=round(on / off, 2),
    )
    print(
        f"shared prefix (32 x 1024+16 -> 16): radix on {on:.1f} tok/s, off {off:.1f} tok/s, "
        f"{on / off:.2f}x"
    )
    # transformers last: it runs in this (main) thread, and OpenMP teams in two threads slow
    # each other on 2 cores; the engines above keep all their work in the scheduler thread.
    torch.set_num_threads(res["threads"])  # an engine's count may have become this thread's
    hf = hf_tps(
        a.model_path, a.dtype, random_prompts(a.hf_requests, a.input_len, vocab, 99), a.output_len
    )
    res["hf_sequential_tok_s"] = round(hf, 1)
    print(f"transformers, one request at a time: {hf:8.1f} tok/s", flush=True)
    for b in a.batch_sizes:
        res[f"ratio_bs{b}_vs_hf"] = round(res[f"engine_bs{b}_tok_s"] / hf, 2)
        print(f"  engine batch {b} / transformers: {res[f'ratio_bs{b}_vs_hf']:.2f}x")
    print(json.dumps(res))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
