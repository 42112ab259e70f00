"""SGLang frontend DSL: constrained `gen` (a regular expression, an integer dtype and a JSON
schema) against a running server.

python -m srt_ascend.launch_server --port 30000 &
python python/frontend_constrained.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import json

import sglang as sgl
from _common import parse_url, report

CALL_REGEX = r"[a-z_]{1,8}\((n|[0-9]{1,2})\)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    },
    "required": ["name", "year"],
    "additionalProperties": False,
}


@sgl.function
def constrained(s, prompt: str):
    s += prompt
    s += sgl.gen("call", max_tokens=24, temperature=0, regex=CALL_REGEX)
    s += "\n# line count: "
    s += sgl.gen("count", max_tokens=8, temperature=0, dtype=int)
    s += "\nrelease = "
    s += sgl.gen("release", max_tokens=48, temperature=0, json_schema=json.dumps(SCHEMA))


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    state = constrained.run(prompt="def fibonacci(n):\n    return ")
    print("call:", repr(state["call"]), "count:", repr(state["count"]))
    print("release:", repr(state["release"]))
    report(
        {
            "call_regex": CALL_REGEX,
            "call": state["call"],
            "count": state["count"],
            "release": state["release"],
            "schema": SCHEMA,
        }
    )


if __name__ == "__main__":
    main()
