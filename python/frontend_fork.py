"""SGLang frontend DSL: `fork` runs several continuations of one prefix in parallel.

python python/frontend_fork.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import sglang as sgl
from _common import parse_url, report

TOPICS = ["a list", "a dict"]


@sgl.function
def two_ways(s, prompt: str):
    s += prompt
    forks = s.fork(len(TOPICS))
    for f, topic in zip(forks, TOPICS):
        f += f"# using {topic}\n"
        f += sgl.gen("code", max_tokens=12, temperature=0)
    forks.join()
    for topic, f in zip(TOPICS, forks):
        s += f"# {topic}:\n" + f["code"] + "\n"
    s += sgl.gen("summary", max_tokens=8, temperature=0)


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    prompt = "# Two ways to store pairs in Python\n"
    state = two_ways.run(prompt=prompt)
    print(state.text())
    report({"prompt": prompt, "topics": TOPICS, "text": state.text(), "summary": state["summary"]})


if __name__ == "__main__":
    main()
