"""SGLang frontend DSL: `run_batch` runs one program over many inputs concurrently.

python python/frontend_run_batch.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import sglang as sgl
from _common import parse_url, report

PROMPTS = ["import os\n", "class Stack:\n", "for i in range(", "# Copyright"]


@sgl.function
def complete(s, prompt: str):
    s += prompt
    s += sgl.gen("body", max_tokens=8, temperature=0)


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    states = complete.run_batch([{"prompt": p} for p in PROMPTS], num_threads=4)
    one_by_one = [complete.run(prompt=p)["body"] for p in PROMPTS]
    for p, st in zip(PROMPTS, states):
        print(repr(p), "->", repr(st["body"]))
    report({"prompts": PROMPTS, "batch": [st["body"] for st in states], "one_by_one": one_by_one})


if __name__ == "__main__":
    main()
