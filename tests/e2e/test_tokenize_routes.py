"""SGLang's tokenizer routes against the real server: /v1/tokenize and /tokenize (a text, a
list of texts, chat messages as a chat completion prompts with them), /v1/detokenize and
/detokenize (a list, a list of lists), and the bounds a generation request has (count,
length, vocabulary; HTTP 400 with a message)."""

from __future__ import annotations

import pytest

TEXT = "def fibonacci(n):\n"
USER = {"role": "user", "content": "y"}


@pytest.mark.parametrize("path", ["/v1/tokenize", "/tokenize"])
def test_tokenize_texts(server, tokenizer, path):
    r = server.post(path, json={"model": "default", "prompt": TEXT})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(TEXT)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    r = server.post(path, json={"prompt": [TEXT, "x"], "add_special_tokens": False})
    plain = [tokenizer.encode(t, add_special_tokens=False) for t in (TEXT, "x")]
    assert r.json()["tokens"] == plain and r.json()["count"] == [len(p) for p in plain]
    assert plain[0] == ids[1:]  # the BOS is the only special token added


def test_tokenize_messages_counts_a_chat_completions_prompt(server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    r = server.post("/v1/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer.encode(rendered)
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]
    without = server.post(
        "/v1/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without["tokens"] == tokenizer.encode(plain) and without["count"] < r.json()["count"]


@pytest.mark.parametrize("path", ["/v1/detokenize", "/detokenize"])
def test_detokenize(server, tokenizer, path):
    ids = tokenizer.encode(TEXT)
    r = server.post(path, json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": tokenizer.decode(ids, skip_special_tokens=True)}
    r = server.post(path, json={"tokens": [ids, []], "skip_special_tokens": False})
    assert r.json() == {"text": [tokenizer.decode(ids), ""]}


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/tokenize", {}, "exactly one of 'prompt' or 'messages'"),
        ("/v1/tokenize", {"prompt": "x", "messages": [USER]}, "exactly one"),
        ("/v1/tokenize", {"prompt": "x" * 2_000_000}, "longer than the model's context length"),
        ("/v1/tokenize", {"prompt": ["x"] * 5000}, "--max-prompts-per-request"),
        ("/v1/tokenize", {"messages": [USER] * 5000}, "5000 messages"),
        ("/v1/tokenize", {"prompt": "x", "tools": [{}]}, "tools is not supported"),
        (
            "/v1/tokenize",
            {"messages": [USER], "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}},
            "chat_template_kwargs.chat_template is not supported",
        ),
        ("/v1/detokenize", {"tokens": [8192]}, "tokens must be integers in [0, 8192)"),
        ("/v1/detokenize", {"tokens": [[1], [-1]]}, "tokens must be integers"),
        ("/v1/detokenize", {"tokens": [1] * 5000}, "5000 tokens cannot fit"),
        ("/v1/detokenize", {"tokens": [[1]] * 5000}, "--max-prompts-per-request"),
        ("/v1/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_bodies_are_refused(server, path, body, message):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]
    assert server.get("/health").status_code == 200
