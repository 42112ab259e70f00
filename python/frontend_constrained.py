"""SGLang frontend DSL: constrained `gen` (a regular expression, an integer dtype and JSON
schemas) against a running server.

python -m srt_ascend.launch_server --port 30000 &
python python/frontend_constrained.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import json

import sglang as sgl
from _common import parse_url, report

CALL_REGEX = r"[a-z_]{1,8}\((n|[0-9]{1,2})\)"
# JSON values: a release year, and the list of its tags (compact: a JSON schema allows any
# whitespace inside arrays and objects, which a small model may fill with newlines)
YEAR = {"type": "integer", "minimum": 1900, "maximum": 2100}
NAME = {"type": "string", "pattern": "^[a-z]{2,8}$"}


@sgl.function
def constrained(s, prompt: str):
    s += prompt
    s += sgl.gen("call", max_tokens=24, temperature=0, regex=CALL_REGEX)
    s += "\n# line count: "
    s += sgl.gen("count", max_tokens=8, temperature=0, dtype=int)
    s += "\nyear = "
    s += sgl.gen("year", max_tokens=8, temperature=0, json_schema=json.dumps(YEAR))
    s += "\nname = "
    s += sgl.gen("name", max_tokens=12, temperature=0, json_schema=json.dumps(NAME))


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    state = constrained.run(prompt="def fibonacci(n):\n    return ")
    print("call:", repr(state["call"]), "count:", repr(state["count"]))
    print("year:", repr(state["year"]), "name:", repr(state["name"]))
    report(
        {
            "call_regex": CALL_REGEX,
            "call": state["call"],
            "count": state["count"],
            "year": state["year"],
            "name": state["name"],
        }
    )


if __name__ == "__main__":
    main()
