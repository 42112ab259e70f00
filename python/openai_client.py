"""The `openai` client against srt_ascend's OpenAI-compatible API: completion and chat,
without and with streaming.

    python python/openai_client.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import openai
from _common import parse_url, report


def main() -> None:
    client = openai.OpenAI(base_url=parse_url(__doc__) + "/v1", api_key="unused")
    model = client.models.list().data[0].id

    completion = client.completions.create(
        model=model, prompt="def fibonacci(n):\n", max_tokens=16, temperature=0
    )
    print("completion:", repr(completion.choices[0].text))

    messages = [{"role": "user", "content": "Write a Python loop."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    print("chat:", repr(chat.choices[0].message.content))

    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    print("streamed chat:", pieces)
    report(
        {
            "model": model,
            "completion": completion.choices[0].text,
            "chat": chat.choices[0].message.content,
            "streamed_chat": "".join(pieces),
            "num_pieces": len(pieces),
            "stream_usage": usage.model_dump() if usage else None,
            "chat_usage": chat.usage.model_dump(),
        }
    )


if __name__ == "__main__":
    main()
