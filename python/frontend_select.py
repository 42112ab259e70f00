"""SGLang frontend DSL: `select` picks the choice the model finds most likely.

python python/frontend_select.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import sglang as sgl
from _common import parse_url, report

CHOICES = ["return n", "import os", "pass"]


@sgl.function
def pick(s, prompt: str):
    s += prompt
    s += sgl.select("choice", choices=CHOICES)


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    prompt = "def identity(n):\n    "
    state = pick.run(prompt=prompt)
    meta = state.get_meta_info("choice")
    print("chose:", repr(state["choice"]))
    report(
        {
            "prompt": prompt,
            "choices": CHOICES,
            "choice": state["choice"],
            "normalized_prompt_logprobs": meta["normalized_prompt_logprobs"],
        }
    )


if __name__ == "__main__":
    main()
