"""SGLang frontend DSL: `gen`, without and with streaming, against a running server.

python -m srt_ascend.launch_server --port 30000 &
python python/frontend_gen.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import sglang as sgl
from _common import parse_url, report


@sgl.function
def complete(s, prompt: str):
    s += prompt
    s += sgl.gen("body", max_tokens=16, temperature=0)


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(parse_url(__doc__)))
    prompt = "def fibonacci(n):\n"
    state = complete.run(prompt=prompt)
    print("gen:", repr(state["body"]))

    stream = complete.run(prompt=prompt, stream=True)
    pieces = list(stream.text_iter(var_name="body"))
    print("streamed pieces:", pieces)
    report(
        {
            "text": state["body"],
            "meta": state.get_meta_info("body"),
            "streamed": "".join(pieces),
            "num_pieces": len(pieces),
            "full_text": state.text(),
        }
    )


if __name__ == "__main__":
    main()
