"""Structured output under load: `sglang.bench_serving` with a JSON-schema workload, grammar on
vs off, MTP off vs K = 2; and the per-step cost of the grammar masks, in-process.

    python benchmark/grammar.py [--sglang-python .venv-sglang/bin/python]
        [--configs off mtp-k2-fia] [--max-concurrency 1 8] [--num-prompts 16]
        [--output-len 64] [--json-out FILE]
    python benchmark/grammar.py --valid-rate [--max-whitespace 0 1 2 4 8 16 32]
        [--requests 100] [--output-len 64] [--temperature 0.8] [--k 2] [--json-out FILE]

Each configuration gets its own server (shipped checkpoint, bf16,
`--constrained-json-disable-any-whitespace` so the tiny model writes compact JSON rather than
newlines); bench_serving runs unmodified on random-ids prompts, once with
`sampling_params.json_schema` = SCHEMA (greedy, up to --output-len tokens, stopping when the
JSON is complete) and once without a grammar (greedy, --output-len tokens). Reported: output
throughput, median TPOT and mean output length per run; then the time one decode step spends
on the grammar (filling the bitmask of every request at each of the K+1 verify positions, and
applying it to the logits, all positions at once) for batches of 1, 8 and 32 requests.

`--valid-rate`: how many outputs of the shipped checkpoint are valid JSON under a schema, per
`--constrained-json-max-whitespace-cnt` value (0: unbounded, SGLang's default). An in-process
Engine (bf16, MTP with `--k` drafts; 0: MTP off) answers `--requests` requests with SGLang's
`test_json_constrained.py` schema (VALID_SCHEMA), seeds 0..n-1, prompts cycled from
VALID_PROMPTS, up to `--output-len` tokens. Per value: outputs that parse and have exactly the
schema's keys, finish reasons, mean output tokens and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from collections import Counter

import torch
from serving import CONFIGS, bench, start_server
from transformers import AutoTokenizer

from srt_ascend import Engine
from srt_ascend.constrained import Grammar, GrammarBackend, GrammarOptions, apply_token_bitmask
from srt_ascend.constrained.matcher import fill_grammar_bitmask
from srt_ascend.server_args import SHIPPED_MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "id": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
        "active": {"type": "boolean"},
    },
    "required": ["name", "id", "tags", "active"],
    "additionalProperties": False,
}
SERVER_ARGS = ["--dtype", "bfloat16", "--constrained-json-disable-any-whitespace"]


def serving_rows(a) -> list[dict]:
    rows = []
    for name in a.configs:
        proc, url = start_server(a.model_path, CONFIGS[name] + SERVER_ARGS)
        try:
            for grammar in (False, True):
                sp = {"max_new_tokens": a.output_len, "temperature": 0}
                sp.update({"json_schema": json.dumps(SCHEMA)} if grammar else {"ignore_eos": True})
                for c in a.max_concurrency:
                    r = bench(a.sglang_python, url, a.model_path, a, c, {"sampling_params": sp})
                    info = json.load(urllib.request.urlopen(url + "/server_info"))
                    acc = info["internal_states"][0].get("avg_spec_accept_length")
                    row = dict(
                        config=name,
                        grammar="json_schema" if grammar else "none",
                        max_concurrency=c,
                        completed=r["completed"],
                        output_throughput=round(r["output_throughput"], 1),
                        median_tpot_ms=round(r["median_tpot_ms"], 2),
                        mean_output_len=round(r["total_output_tokens"] / r["completed"], 1),
                        accept_length=round(acc, 3) if acc else None,
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return rows


def mask_cost_rows(model_path: str, k: int = 2, steps: int = 50) -> list[dict]:
    """Per decode step: fill the bitmask of the K+1 verify positions of every request and apply
    it to their logits at once (as `verify_logits` does), for a batch of requests part-way
    through SCHEMA (each at its own depth)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    vocab = len(tokenizer)
    backend = GrammarBackend(
        tokenizer, vocab, [tokenizer.eos_token_id or 1], GrammarOptions(json_any_whitespace=False)
    )
    compiled = backend.compile(("json_schema", json.dumps(SCHEMA))).result()
    sample = tokenizer.encode(
        '{"name": "srt", "id": 42, "tags": ["a", "b"], "active": true}', add_special_tokens=False
    )
    rows = []
    for batch in (1, 8, 32):
        grammars, drafts = [], []
        for i in range(batch):
            g = Grammar(compiled)
            depth = i % (len(sample) - k)
            for t in sample[:depth]:
                assert g.accept(t)
            grammars.append(g)
            drafts.append(sample[depth : depth + k])
        logits = torch.randn(batch * (k + 1), vocab)
        per_position = [g for g in grammars for _ in range(k + 1)]
        lookaheads = [d[:j] for d in drafts for j in range(k + 1)]
        start = time.perf_counter()
        for _ in range(steps):
            apply_token_bitmask(logits, fill_grammar_bitmask(per_position, lookaheads, vocab))
        ms = (time.perf_counter() - start) * 1000 / steps
        rows.append(dict(batch=batch, verify_positions=k + 1, grammar_ms_per_step=round(ms, 3)))
        print(json.dumps(rows[-1]), flush=True)
    backend.shutdown()
    return rows


VALID_SCHEMA = {  # SGLang's test/srt/test_json_constrained.py
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[\\w]+$"},
        "population": {"type": "integer"},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
VALID_PROMPTS = [
    "Here is the information of the capital of France in the JSON format.\n",
    "config = ",
    "def load(path):\n    return ",
    "# Copyright",
    'data = {"name": ',
]


def valid(text: str) -> bool:
    """Parses as JSON with exactly VALID_SCHEMA's keys."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == {"name", "population"}


def valid_rate(max_ws: int, args: argparse.Namespace) -> dict:
    """Valid-JSON outputs of --requests seeded sampled requests at one whitespace bound."""
    engine = Engine(
        speculative_algorithm="MTP" if args.k else None,
        speculative_num_steps=max(args.k, 1),
        constrained_json_max_whitespace_cnt=max_ws,
    )
    try:
        params = [
            {
                "max_new_tokens": args.output_len,
                "temperature": args.temperature,
                "seed": i,
                "json_schema": json.dumps(VALID_SCHEMA),
            }
            for i in range(args.requests)
        ]
        prompts = [VALID_PROMPTS[i % len(VALID_PROMPTS)] for i in range(args.requests)]
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    finish = Counter(str((o["meta_info"]["finish_reason"] or {}).get("type")) for o in outs)
    return {
        "max_whitespace": max_ws,
        "valid": sum(valid(o["text"]) for o in outs),
        "requests": len(outs),
        "finish": dict(finish),
        "mean_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs) / len(outs),
        "seconds": round(seconds, 1),
        "example": outs[0]["text"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sglang-python", default=os.environ.get("SRT_SGLANG_PYTHON", ".venv-sglang/bin/python")
    )
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument(
        "--configs", nargs="+", default=["off", "mtp-k2-fia"], choices=list(CONFIGS), metavar="CFG"
    )
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json-out", default=None)
    p.add_argument("--valid-rate", action="store_true", help="valid-JSON rate per bound instead")
    p.add_argument("--max-whitespace", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    p.add_argument("--requests", type=int, default=100, help="--valid-rate")
    p.add_argument("--temperature", type=float, default=0.8, help="--valid-rate")
    p.add_argument("--k", type=int, default=2, help="--valid-rate's MTP drafts (0: MTP off)")
    a = p.parse_args()
    if a.valid_rate:
        rows = []
        for ws in a.max_whitespace:
            rows.append(valid_rate(ws, a))
            print(json.dumps(rows[-1]), flush=True)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    a.dataset = "random-ids"
    result = {"mask_cost": mask_cost_rows(a.model_path), "serving": serving_rows(a)}
    print("| config | grammar | concurrency | output tok/s | median TPOT ms | mean output len |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["serving"]:
        print(
            f"| {r['config']} | {r['grammar']} | {r['max_concurrency']} | "
            f"{r['output_throughput']} | {r['median_tpot_ms']} | {r['mean_output_len']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
