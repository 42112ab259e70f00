"""Collectives and bytes per decode step and per verify step: one process vs tensor (and
expert) parallelism and data-parallel attention, with the step time beside them.

    python benchmark/parallel.py [--batch 4] [--input-len 64] [--output-len 32]
        [--modes tp1 tp2 tp2-ep2 dp2 dp2-graphs dp2-ep2 dp2-ep2-a2a] [--num-threads 1]
        [--json-out FILE]

For each mode, an Engine (float32, --device cpu unless --device is given) runs `batch`
concurrent greedy requests twice: MTP off (decode steps) and MTP K=2 with FIA verify (verify
steps: K draft forwards, the verify forward and the draft-extend pass). Rank 0's collective
counters (`TPGroup.counts`: calls and the bytes each rank puts in, by kind) are read around
every decoder step; prefill steps are left out. The scheduler's one object broadcast (or, with
DP attention, all-gather) per loop (its messages) is not counted. With DP attention
(`dp2`: --tp-size 2 --enable-dp-attention --dp-size 2) the requests are spread over the two
DP groups (round robin) and rank 0's steps are those of its group's half of the batch; each
forward adds one all-gather of the groups' token counts and graph choices (gloo, 3 integers:
24 bytes) and gathers every group's tokens before each MLP (`dp_gather`, padded to the larger
group); `dp2-graphs` replays graphs (`--enable-cpu-graph`, buckets 1 2 4 8), whose gathers pad
every group to the agreed bucket (on CPU a replay reruns the forward, so its collectives are
counted; a CUDA graph's replays are not: the counters are host-side); with
`--moe-a2a-backend all_to_all` (`dp2-ep2-a2a`) each MoE layer runs three all-to-alls instead
(the per-expert counts, the token rows out, the expert outputs back). On this 2-core
CPU two ranks are not expected to be faster than one; the counts are the point (the device
script runs the same modes on GPUs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from srt_ascend import Engine

DP2 = {"tp_size": 2, "enable_dp_attention": True, "dp_size": 2}
MODES = {
    "tp1": {},
    "tp2": {"tp_size": 2},
    "tp2-ep2": {"tp_size": 2, "ep_size": 2},
    "dp2": DP2,
    "dp2-graphs": {**DP2, "enable_cpu_graph": True, "cuda_graph_bs": (1, 2, 4, 8)},
    "dp2-ep2": {**DP2, "ep_size": 2},
    "dp2-ep2-a2a": {**DP2, "ep_size": 2, "moe_a2a_backend": "all_to_all"},
}
# TPGroup.counts' names
KINDS = ("all_reduce", "all_gather", "dp_counts", "dp_gather", "all_to_all")
SPEC = {
    "decode": {},
    "verify": {
        "speculative_algorithm": "MTP",
        "speculative_num_steps": 2,
        "speculative_verify": "fia",
    },
}


def measure(engine_kwargs: dict, prompts: list[list[int]], output_len: int) -> dict:
    """Per decoder step: collectives and bytes by kind, and wall ms (medians over steps)."""
    engine = Engine(**engine_kwargs)
    try:
        scheduler = engine.tokenizer_manager.scheduler
        counts = scheduler.runner.tp.counts
        steps: list[tuple[dict, float]] = []
        decoder_step = scheduler.decoder.step

        def counted_step(reqs):
            before, t0 = copy.deepcopy(counts), time.perf_counter()
            out = decoder_step(reqs)
            wall = time.perf_counter() - t0
            delta = {k: [v[0] - before.get(k, [0, 0])[0], v[1] - before.get(k, [0, 0])[1]]
                     for k, v in counts.items()}  # fmt: skip
            steps.append((delta, wall))
            return out

        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts[0][:8], sampling_params={**params, "max_new_tokens": 4})
        scheduler.decoder.step = counted_step  # the steps of the measured batch only
        engine.generate(input_ids=prompts, sampling_params=params)
        scheduler.decoder.step = decoder_step
    finally:
        engine.shutdown()
    kinds = sorted({k for d, _ in steps for k in d})
    return {
        "steps": len(steps),
        "ms_per_step": 1000 * statistics.median(w for _, w in steps),
        **{f"{k}_calls": statistics.median(d.get(k, [0, 0])[0] for d, _ in steps) for k in kinds},
        **{f"{k}_bytes": statistics.median(d.get(k, [0, 0])[1] for d, _ in steps) for k in kinds},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=1, help="per rank")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 8000, (a.batch, a.input_len), generator=g).tolist()
    rows = []
    for mode in a.modes:
        for step_kind, spec in SPEC.items():
            kwargs = {"device": a.device, "dtype": "float32", "max_total_tokens": 8192}
            kwargs["num_threads"] = a.num_threads
            r = measure({**kwargs, **MODES[mode], **spec}, prompts, a.output_len)
            rows.append({"mode": mode, "step": step_kind, "batch": a.batch, **r})
            print(json.dumps(rows[-1]), flush=True)
    head = "| mode | step | " + " | ".join(f"{k} calls" for k in KINDS)
    print(f"\n{head} | bytes in per rank | ms/step (B={a.batch}) |")
    print("| --- | --- |" + " --- |" * (len(KINDS) + 2))
    for r in rows:
        calls = " | ".join(f"{r.get(f'{k}_calls', 0):g}" for k in KINDS)
        nbytes = sum(r.get(f"{k}_bytes", 0) for k in KINDS)
        print(
            f"| {r['mode']} | {r['step']} | {calls} | {nbytes / 1024:.1f} KiB | "
            f"{r['ms_per_step']:.1f} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
