"""Quantized checkpoints against bf16, side by side in one run: the shipped checkpoint written
by `srt_ascend.tools.quantize` in each scheme (MTP layer quantized too with --quant-mtp).

    python benchmark/quant.py [--schemes w8a8 w8a8_dynamic fp8_block] [--quant-mtp]
        [--batch-sizes 1 16] [--input-len 128] [--output-len 64] [--prompts 50]
        [--ppl-windows 16] [--rounds 2] [--no-fallback] [--out-dir DIR] [--json-out FILE]
        [--speed-only] [--torch-ops]

Per scheme:
- weight memory, read from the running server (its internal state, as /get_server_info
  reports it; main model + MTP layer): the quantized scope's bytes (every linear layer and
  expert stack of a decoder layer holding a quantized layer, the ones the quantizer's
  fallback kept FLOAT included: weights, scales, offsets, biases) over the bytes the same
  layers take in bf16; and the whole model's ratio;
- quality: greedy agreement (`agree`) = share of output positions whose token equals bf16's,
  over `--prompts` held-out prompts (corpus files the tiny model never trained on), 32 tokens
  each, free running (after a first difference the continuations part); `top1`: the share of
  positions of the held-out windows whose argmax equals bf16's on the same text (teacher
  forced); perplexity ratio over `--ppl-windows` held-out windows of 256 tokens (dense);
- MTP: the accept length of K = 2 greedy decoding of those prompts, beside bf16's;
- speed: decode throughput at each batch size (B random prompts of input-len tokens, one
  generate of output-len greedy tokens; engines alternate `rounds` times, best round kept:
  this machine is shared), as a ratio to bf16's. With `--torch-ops` the int8 schemes run a
  second time on the torch-op path instead of the fused CPU ops (`layers/ops/cpu_int8.py`);
  `--speed-only` skips the quality and memory columns. `cpu x`: bf16's process CPU seconds
  per token over the variant's (best round; > 1: fewer CPU seconds per token than bf16).
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch
from deterministic import measure, random_prompts
from workload_args import workload_parser

from srt_ascend import Engine
from srt_ascend.layers.ops import cpu_int8
from srt_ascend.models.loader import load_config, load_model, shard_files
from srt_ascend.models.quant_config import resolve_quantization
from srt_ascend.tools.corpus import list_files, split
from srt_ascend.tools.quantize import SCHEMES, Calibration, quantize_checkpoint


def load(path: str):
    config = load_config(path)
    q = resolve_quantization(path, config, None, shard_files(path))
    return load_model(path, torch.bfloat16, load_mtp=True, config=config, quantization=q)


def held_out_texts() -> list[str]:
    _, held = split(list_files())
    return [t for t in (f.read() for f in held) if len(t) > 2000]


def prompts_of(texts: list[str], n: int) -> list[str]:
    out = []
    for i, text in enumerate(texts[:n]):
        start = (i * 997) % (len(text) - 600)
        out.append(text[start : start + 60 + (i * 37) % 300])
    return out


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], windows: int, seq: int = 256):
    """(perplexity, the argmax token at every position) over the held-out windows."""
    nll, count, top1 = 0.0, 0, []
    for text in texts[:windows]:
        ids = tokenizer.encode(text[: 8 * seq]).ids[: seq + 1]
        x = torch.tensor([ids])
        logits = model.compute_logits(model(x[:, :-1], torch.arange(x.shape[1] - 1)))
        loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
        nll, count = nll + float(loss), count + x.shape[1] - 1
        top1.append(logits[0].argmax(-1))
    return math.exp(nll / count), torch.cat(top1)


def greedy(path: str, prompts: list[str]) -> tuple[list[list[int]], dict]:
    """The prompts' greedy outputs with MTP K = 2, and the server's internal state after."""
    engine = Engine(
        model_path=path, dtype="bfloat16", speculative_algorithm="MTP", speculative_num_steps=2
    )
    try:
        params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(prompts, params)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        return [o["output_ids"] for o in outs], engine.get_internal_state()
    finally:
        engine.shutdown()


def speed_variants(paths: dict[str, str], torch_ops: bool) -> dict[str, tuple[str, bool]]:
    """name -> (checkpoint, fused CPU int8 ops): each engine, and with --torch-ops each int8
    scheme once more on the torch-op path (`layers/ops/cpu_int8.py`)."""
    out = {name: (path, True) for name, path in paths.items()}
    if torch_ops:
        for name in [n for n in paths if n in ("w8a8", "w8a8_dynamic")]:
            out[f"{name}/torch-ops"] = (paths[name], False)
    return out


def throughput(variants: dict[str, tuple[str, bool]], args) -> dict[str, dict]:
    """Per variant and batch size: decode tokens/s and the process's CPU seconds per token
    (less sensitive to other processes on a shared machine than wall time); engines
    interleaved, best of the rounds."""
    prompts = random_prompts(max(args.batch_sizes), args.input_len, 8192, seed=0)
    best: dict[str, dict] = {name: {"tps": {}, "cpu": {}} for name in variants}
    for _ in range(args.rounds):
        for name, (path, fused) in variants.items():
            cpu_int8.configure(fused)
            engine = Engine(model_path=path, dtype="bfloat16", disable_radix_cache=True)
            try:
                engine.generate(input_ids=prompts[0][:8], sampling_params={"max_new_tokens": 2})
                for b in args.batch_sizes:
                    tps, _, cpu = measure(engine, prompts[:b], args.output_len)
                    row = best[name]
                    row["tps"][b] = max(row["tps"].get(b, 0.0), tps)
                    row["cpu"][b] = min(row["cpu"].get(b, math.inf), cpu)
            finally:
                engine.shutdown()
    return best


def quality(paths: dict[str, str], args) -> dict[str, dict]:
    """Per checkpoint: memory measured in its server, greedy agreement, perplexity, accept."""
    from tokenizers import Tokenizer

    texts = held_out_texts()
    prompts = prompts_of(texts, args.prompts)
    tokenizer = Tokenizer.from_file(os.path.join(args.model_path, "tokenizer.json"))
    rows: dict[str, dict] = {}
    ref_tokens = ref_top1 = None
    for name, path in paths.items():
        model, mtp = load(path)
        ppl, top1 = perplexity(model, tokenizer, texts[args.prompts :], args.ppl_windows)
        ref_top1 = top1 if ref_top1 is None else ref_top1
        del model, mtp
        tokens, state = greedy(path, prompts)
        quant, as_bf16 = state["quantized_weight_bytes"], state["quantized_weight_bytes_as_bf16"]
        ref_tokens = ref_tokens or tokens
        same = sum(a == b for x, y in zip(tokens, ref_tokens) for a, b in zip(x, y))
        rows[name] = {
            "quantized_bytes": quant,
            "memory_ratio": quant / as_bf16 if as_bf16 else 1.0,
            "model_bytes": state["weight_bytes"],
            "ppl": ppl,
            "agreement": same / sum(len(x) for x in ref_tokens),
            "top1_agreement": float((top1 == ref_top1).float().mean()),
            "accept_length": state["avg_spec_accept_length"],
        }
    return rows


def print_table(rows: dict[str, dict], batch_sizes: list[int]) -> None:
    base = rows["bf16"]
    header = f"{'':22}{'mem(q)':>8}{'mem(all)':>9}{'agree':>7}{'top1':>7}{'ppl':>8}{'ppl x':>7}"
    header += f"{'accept':>7}"
    header += "".join(f"{f'tok/s B={b}':>13}{'x':>6}{'cpu x':>7}" for b in batch_sizes)
    print(header)
    for name, r in rows.items():
        line = f"{name:22}"
        if "ppl" in r:
            line += f"{r['memory_ratio']:8.3f}{r['model_bytes'] / base['model_bytes']:9.3f}"
            line += f"{r['agreement']:7.3f}{r['top1_agreement']:7.3f}"
            line += f"{r['ppl']:8.3f}{r['ppl'] / base['ppl']:7.3f}{r['accept_length']:7.2f}"
        else:
            line += " " * 53
        for b in batch_sizes:
            tps, cpu = r["tokens_per_s"][b], r["cpu_s_per_token"][b]
            line += f"{tps:13.1f}{tps / base['tokens_per_s'][b]:6.2f}"
            line += f"{base['cpu_s_per_token'][b] / cpu:7.2f}"
        print(line)


def main() -> None:
    p = workload_parser(__doc__)
    p.set_defaults(batch_sizes=[1, 16], output_len=64)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--quant-mtp", action="store_true")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-fallback", action="store_true", help="quantize every layer in scope")
    p.add_argument("--out-dir", help="keep the quantized copies here (reused when present)")
    p.add_argument("--speed-only", action="store_true", help="throughput rows only")
    p.add_argument("--torch-ops", action="store_true", help="int8 schemes on the torch-op path too")
    args = p.parse_args()
    tmp = args.out_dir or tempfile.mkdtemp(prefix="quant_bench_")
    calibration = Calibration(memory_ratio=None) if args.no_fallback else Calibration()
    paths = {"bf16": args.model_path}
    for s in args.schemes:
        dst = os.path.join(tmp, s)
        if not os.path.isfile(os.path.join(dst, "config.json")):
            quantize_checkpoint(args.model_path, dst, s, args.quant_mtp, calibration)
        paths[s] = dst
    rows = {} if args.speed_only else quality(paths, args)
    for name, speed in throughput(speed_variants(paths, args.torch_ops), args).items():
        rows.setdefault(name, {})["tokens_per_s"] = speed["tps"]
        rows[name]["cpu_s_per_token"] = speed["cpu"]
    print_table(rows, args.batch_sizes)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
