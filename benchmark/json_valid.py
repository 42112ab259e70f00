"""Valid-JSON rate of the shipped checkpoint under a JSON schema, per whitespace bound.

    python benchmark/json_valid.py [--max-whitespace 0 1 2 4] [--requests 100]
        [--max-new-tokens 64] [--temperature 0.8] [--k 2]

For each --constrained-json-max-whitespace-cnt value (0: unbounded, SGLang's default) an
in-process Engine (MTP with K drafts, bf16) answers `--requests` requests with SGLang's
`test_json_constrained.py` schema, seeds 0..n-1, prompts cycled from PROMPTS. Reported per
value: outputs that parse as JSON and follow the schema's required keys, finish reasons, mean
output tokens and the wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from srt_ascend import Engine

SCHEMA = {  # SGLang's test/srt/test_json_constrained.py
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[\\w]+$"},
        "population": {"type": "integer"},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
PROMPTS = [
    "Here is the information of the capital of France in the JSON format.\n",
    "config = ",
    "def load(path):\n    return ",
    "# Copyright",
    'data = {"name": ',
]


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == {"name", "population"}


def measure(max_ws: int, args: argparse.Namespace) -> dict:
    engine = Engine(
        speculative_algorithm="MTP" if args.k else None,
        speculative_num_steps=max(args.k, 1),
        constrained_json_max_whitespace_cnt=max_ws,
    )
    try:
        params = [
            {
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature,
                "seed": i,
                "json_schema": json.dumps(SCHEMA),
            }
            for i in range(args.requests)
        ]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-whitespace", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--k", type=int, default=2, help="MTP drafts per step (0: MTP off)")
    args = p.parse_args()
    for ws in args.max_whitespace:
        print(json.dumps(measure(ws, args)), flush=True)


if __name__ == "__main__":
    main()
