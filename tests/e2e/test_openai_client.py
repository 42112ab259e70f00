"""The `openai` Python client against /v1: models, completions and chat, streaming or not."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-mtp"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def native(server, ids_or_text, n: int) -> dict:
    key = "text" if isinstance(ids_or_text, str) else "input_ids"
    body = {key: ids_or_text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    return server.post("/generate", json=body).json()


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == server.get("/model_info").json()["context_length"]


def test_completion_matches_native(client, server):
    prompt = "def fibonacci(n):\n"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    expected = native(server, prompt, 8)
    choice = resp.choices[0]
    assert choice.text == expected["text"]
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert resp.usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"


def test_completion_batch_n_logprobs_echo(client, server):
    prompts = ["import os\n", "x = 1\n"]
    resp = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2, logprobs=2
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for i, c in enumerate(resp.choices):
        assert c.text == native(server, prompts[i // 2], 4)["text"]
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert "".join(lp.tokens) == c.text
        assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
        assert lp.text_offset[0] == 0
    echo = client.completions.create(
        model=MODEL, prompt="x = 1\n", max_tokens=2, temperature=0, echo=True
    )
    assert echo.choices[0].text == "x = 1\n" + native(server, "x = 1\n", 2)["text"]


def test_seeded_parallel_samples_match_generate(client, server):
    """n > 1 with a seed: n different samples, the same on /v1/completions as on /generate
    (one derivation of the samples' seeds), and the same again for the same request."""
    prompt = "def parse(self, text):\n    "
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    resp = client.completions.create(model=MODEL, prompt=prompt, **sampled)
    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    params = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    native_outs = server.post("/generate", json={"text": prompt, "sampling_params": params})
    assert [o["text"] for o in native_outs.json()] == texts
    assert len(set(texts)) == 3, texts
    again = client.completions.create(model=MODEL, prompt=prompt, **sampled)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_completion_stream_with_usage(client, server):
    prompt = "class Stack:\n"
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = native(server, prompt, 6)
    assert text == expected["text"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("length", "stop")


def test_chat_uses_the_chat_template(client, server, tokenizer):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a loop."},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    expected = native(server, ids, 8)
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == expected["text"]
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


def test_chat_stream_with_usage_and_logprobs(client):
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(t.token for t in content) == full.choices[0].message.content
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)


def test_chat_n_and_logit_bias(client, server, tokenizer):
    """n choices per chat request, seeded samples reproducible; logit_bias moves greedy
    decoding onto the favoured token and off the banned one."""
    messages = [{"role": "user", "content": "count"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=5, temperature=1.0, seed=11, n=3)
    first, again = (client.chat.completions.create(**kw) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert 3 <= first.usage.completion_tokens <= 15
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    top_id = native(server, prompt, 1)["output_ids"][0]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0
    )
    assert plain.choices[0].message.content == tokenizer.decode([top_id])
    favoured = tokenizer.encode("zebra", add_special_tokens=False)[0]
    biased = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={str(favoured): 100.0},
    )
    assert biased.choices[0].logprobs.content[0].token == tokenizer.decode([favoured])
    banned = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={str(top_id): -100.0},
    )
    assert banned.choices[0].logprobs.content[0].token != tokenizer.decode([top_id])
    assert favoured != top_id


def test_logprobs_of_a_split_character_keep_its_bytes(client, tokenizer):
    """A token that holds part of a character (it decodes to U+FFFD): chat logprobs give its
    own bytes (joined, they make the character), completion logprobs name it by its bytes as
    latin-1 characters, so two such tokens stay two top_logprobs entries (SGLang's)."""
    ids = tokenizer.encode("漢", add_special_tokens=False)
    assert len(ids) > 1 and tokenizer.decode(ids[:1]) == "\ufffd"
    bias = {str(ids[0]): 100.0, str(ids[1]): 60.0}
    raw = [list("漢".encode()[:1]), list("漢".encode()[1:2])]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        logit_bias=bias,
    )
    entry = chat.choices[0].logprobs.content[0]
    assert entry.bytes == raw[0] and [t.bytes for t in entry.top_logprobs] == raw
    comp = client.completions.create(
        model=MODEL, prompt="a", max_tokens=1, temperature=0, logprobs=2, logit_bias=bias
    )
    lp = comp.choices[0].logprobs
    names = [bytes(b).decode("latin-1") for b in raw]
    assert lp.tokens == names[:1] and list(lp.top_logprobs[0]) == names


def test_openai_errors_raise_bad_request(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    assert e.value.status_code == 400 and "max_new_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    ok = client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert ok.usage.completion_tokens == 1
