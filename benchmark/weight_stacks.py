"""Weight stacks on vs off (layers/weight_stack.py), side by side in one engine.

    python benchmark/weight_stacks.py [--dtype bfloat16] [--batch-sizes 1 8 32]
        [--output-len 128] [--rounds 3] [--speculative-num-steps K [--speculative-verify V]]
        [--json-out FILE]

One engine on the shipped checkpoint; for each round and batch size, B concurrent random
128-token prompts decode `output-len` greedy tokens (ignore_eos) with the stacks in place, then
with every module sent back to its unstacked path (the same weights), alternating, so the
VM's drift hits both alike. Reports median tokens/s of each and their ratio, and checks that
both layouts produced the same tokens (float32 sums may differ in the last bit in bf16:
reported, not hidden). With --speculative-num-steps K the engine runs MTP with K drafts.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from workload_args import workload_parser

from srt_ascend import Engine
from srt_ascend.layers.moe import DeepseekMoE, DenseMLP
from srt_ascend.models.deepseek_v3 import MLAAttention

STACK_ATTRS = {MLAAttention: "qkv_a", DeepseekMoE: "stacks", DenseMLP: "gate_up"}


def stack_holders(runner) -> list[tuple[object, str, object]]:
    """(module, attribute, its stack) for every stacked module of the model and MTP."""
    out = []
    for model in (runner.model, runner.mtp):
        for m in model.modules() if model is not None else ():
            attr = STACK_ATTRS.get(type(m))
            if attr and getattr(m, attr) is not None:
                out.append((m, attr, getattr(m, attr)))
    return out


def main() -> None:
    p = workload_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speculative-num-steps", type=int, default=0, help="0: MTP off")
    p.add_argument("--speculative-verify", default="fia", choices=["expand", "fia"])
    a = p.parse_args()
    spec = {}
    if a.speculative_num_steps:
        spec = dict(
            speculative_algorithm="MTP",
            speculative_num_steps=a.speculative_num_steps,
            speculative_verify=a.speculative_verify,
        )
    engine = Engine(model_path=a.model_path, dtype=a.dtype, **spec)
    holders = stack_holders(engine.tokenizer_manager.runner)
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    gen = torch.Generator().manual_seed(0)
    vocab = engine.tokenizer_manager.runner.vocab_size
    try:
        engine.generate(input_ids=[[5, 6, 7]], sampling_params={**params, "max_new_tokens": 4})
        speed = {(b, on): [] for b in a.batch_sizes for on in (True, False)}
        same = {b: True for b in a.batch_sizes}
        for _ in range(a.rounds):
            for b in a.batch_sizes:
                ids = torch.randint(3, vocab, (b, a.input_len), generator=gen).tolist()
                outs = {}
                for on in (True, False):
                    for m, attr, stack in holders:  # the scheduler is idle between calls
                        setattr(m, attr, stack if on else None)
                    engine.flush_cache()
                    t0 = time.perf_counter()
                    res = engine.generate(input_ids=ids, sampling_params=params)
                    speed[b, on].append(b * a.output_len / (time.perf_counter() - t0))
                    outs[on] = [r["output_ids"] for r in res]
                same[b] = same[b] and outs[True] == outs[False]
        for m, attr, stack in holders:
            setattr(m, attr, stack)
    finally:
        engine.shutdown()
    rows = []
    for b in a.batch_sizes:
        on, off = statistics.median(speed[b, True]), statistics.median(speed[b, False])
        rows.append(
            dict(batch=b, stacked_tok_s=round(on, 1), unstacked_tok_s=round(off, 1),
                 ratio=round(on / off, 3), identical_outputs=same[b],
                 stacked_runs=[round(v, 1) for v in speed[b, True]],
                 unstacked_runs=[round(v, 1) for v in speed[b, False]])
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print("\n| batch | stacked tokens/s | unstacked tokens/s | ratio | identical outputs |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['stacked_tok_s']} | {r['unstacked_tok_s']} | "
            f"{r['ratio']}x | {r['identical_outputs']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(
                dict(dtype=a.dtype, output_len=a.output_len, spec=spec, rows=rows), f, indent=1
            )


if __name__ == "__main__":
    main()
