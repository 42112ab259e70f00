"""The shipped checkpoint's JSON-schema outputs finish under the default whitespace bound
(--constrained-json-max-whitespace-cnt): sampled at temperature 0.8 with MTP (K = 2), most
outputs are complete JSON objects of the schema, where with unbounded whitespace (SGLang's
default, the control) most run on in newlines and spaces until the token limit.

Measured over 100 requests (benchmark/grammar.py --valid-rate): 28 valid unbounded, 88 at the
default 16. Here 24 seeded requests each: the test needs at least 15 valid with the default and
at most 12 with the control; at the measured rates a miss is below 1% either way (binomial)."""

from __future__ import annotations

import json

import pytest

from srt_ascend import Engine
from srt_ascend.server_args import ServerArgs

SCHEMA = {  # SGLang's test_json_constrained.py
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
N = 24


def valid_outputs(model_path: str, max_ws: int) -> int:
    engine = Engine(
        model_path=model_path,
        speculative_algorithm="MTP",
        speculative_num_steps=2,
        constrained_json_max_whitespace_cnt=max_ws,
    )
    try:
        params = [
            {"max_new_tokens": 64, "temperature": 0.8, "seed": i, "json_schema": json.dumps(SCHEMA)}
            for i in range(N)
        ]
        outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(N)], params)
    finally:
        engine.shutdown()
    ok = 0
    for o in outs:
        try:
            obj = json.loads(o["text"])
        except ValueError:
            continue
        ok += isinstance(obj, dict) and set(obj) == {"name", "population"}
    return ok


@pytest.mark.parametrize(
    "max_ws, lo, hi",
    [(ServerArgs.constrained_json_max_whitespace_cnt, 15, N), (0, 0, 12)],
    ids=["default", "unbounded-control"],
)
def test_json_outputs_finish_under_the_default_whitespace_bound(model_path, max_ws, lo, hi):
    assert lo <= valid_outputs(model_path, max_ws) <= hi
