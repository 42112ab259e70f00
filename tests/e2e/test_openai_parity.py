"""SGLang API parity on the OpenAI routes (raw HTTP and the `openai` client), with MTP off and
on where tokens are generated: extension fields honoured or refused alike on /generate,
/v1/completions and /v1/chat/completions; SGLang's length defaults and its 400 for an overlong
max_tokens; cache_salt isolation; /v1/models/{id}, /v1/responses, /v1/score; echo with
logprobs; out-of-vocabulary stop_token_ids; SGLang's scheduler log lines."""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import openai
import pytest

CHAT = [{"role": "user", "content": "def f("}]
TOO_LONG = "exceeds the model's maximum context length"


@pytest.fixture(params=["plain", "mtp"])
def srv(request):
    """The shared plain server, then this module's MTP server."""
    return request.getfixturevalue("server" if request.param == "plain" else "mtp_server")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _unique(text: str) -> str:
    """A prompt no earlier test cached."""
    return f"{text} {uuid.uuid4().hex}"


# ---- 1. extension fields: honoured or refused alike on every route ---------------------------

# field on /v1 -> (value, its name in /generate's sampling_params)
SAMPLING_EXTENSIONS = {
    "regex": ("[0-9]+", "regex"),
    "json_schema": ('{"type": "object"}', "json_schema"),
    "ebnf": ('root ::= "a"', "ebnf"),
    "stop_regex": ("[.]", "stop_regex"),
    "logit_bias": ({"5": -100.0}, "logit_bias"),
    "min_tokens": (2, "min_new_tokens"),
    "top_k": (5, "top_k"),
    "min_p": (0.05, "min_p"),
    "repetition_penalty": (1.1, "repetition_penalty"),
    "ignore_eos": (True, "ignore_eos"),
    "no_stop_trim": (True, "no_stop_trim"),
    "skip_special_tokens": (False, "skip_special_tokens"),
    "stop_token_ids": ([10**9], "stop_token_ids"),  # out of vocabulary: never matches
}
REQUEST_FIELDS = {
    "lora_path": "adapter",
    "custom_logit_processor": "processor",
    "return_hidden_states": True,
}


def _routes(server, v1_fields: dict, native_sp: dict, native_top: dict):
    """(status, error message) of /generate, /v1/completions, /v1/chat/completions."""
    sp = {"max_new_tokens": 2, **native_sp}
    bodies = [
        ("/generate", {"text": "def f(", "sampling_params": sp, **native_top}),
        (
            "/v1/completions",
            {"model": "tiny-mtp", "prompt": "def f(", "max_tokens": 2, **v1_fields},
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny-mtp", "messages": CHAT, "max_tokens": 2, **v1_fields},
        ),
    ]
    out = []
    for path, body in bodies:
        r = server.post(path, json=body)
        err = r.json().get("error", {}).get("message") if path == "/generate" else None
        out.append((r.status_code, err if err is not None else r.json().get("message")))
    return out


@pytest.mark.parametrize("field", list(SAMPLING_EXTENSIONS))
def test_sampling_extension_is_decided_alike_on_every_route(server, field):
    value, native = SAMPLING_EXTENSIONS[field]
    results = _routes(server, {field: value}, {native: value}, {})
    statuses = {status for status, _ in results}
    assert len(statuses) == 1 and statuses <= {200, 400}, results
    if statuses == {400}:
        assert all(f"{native} is not supported" in msg for _, msg in results), results


@pytest.mark.parametrize("field", list(REQUEST_FIELDS))
def test_request_field_is_decided_alike_on_every_route(server, field):
    value = REQUEST_FIELDS[field]
    results = _routes(server, {field: value}, {}, {field: value})
    assert [status for status, _ in results] == [400] * 3, results
    assert all(msg == f"{field} is not supported by this server" for _, msg in results)


def test_openai_client_sees_the_same_decision(server):
    client = _client(server)
    native = server.post("/generate", json={"text": "a", "sampling_params": {"regex": "[0-9]"}})
    call = dict(model="tiny-mtp", messages=CHAT, max_tokens=2, extra_body={"regex": "[0-9]"})
    if native.status_code == 400:
        with pytest.raises(openai.BadRequestError, match="regex is not supported"):
            client.chat.completions.create(**call)
    else:
        assert client.chat.completions.create(**call).choices[0].message.content.isdigit()
    fmt = {"type": "json_object"}
    native = server.post(
        "/generate", json={"text": "a", "sampling_params": {"json_schema": '{"type":"object"}'}}
    )
    if native.status_code == 400:
        with pytest.raises(openai.BadRequestError, match="json_schema is not supported"):
            client.chat.completions.create(model="tiny-mtp", messages=CHAT, response_format=fmt)


def test_honoured_extensions_change_the_output(srv):
    """top_k=1 is greedy, min_tokens holds back EOS, stop_token_ids stop: as on /generate."""
    client = _client(srv)
    greedy = client.completions.create(
        model="tiny-mtp", prompt="def f(", max_tokens=6, temperature=0
    )
    top1 = client.completions.create(
        model="tiny-mtp", prompt="def f(", max_tokens=6, temperature=1.0, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == greedy.choices[0].text
    native = srv.post(
        "/generate",
        json={"text": "def f(", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()
    stop_id = native["output_ids"][2]
    stopped = client.completions.create(
        model="tiny-mtp",
        prompt="def f(",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "no_stop_trim": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == native["output_ids"].index(stop_id) + 1


def test_continue_final_message_extends_the_assistant_turn(srv, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f("}]
    body = {"model": "tiny-mtp", "messages": messages, "max_tokens": 4, "temperature": 0}
    cont = srv.post("/v1/chat/completions", json={**body, "continue_final_message": True}).json()
    plain = srv.post("/v1/chat/completions", json=body).json()
    open_end = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    new_turn = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert cont["usage"]["prompt_tokens"] == len(tokenizer.encode(open_end))
    assert plain["usage"]["prompt_tokens"] == len(tokenizer.encode(new_turn))
    native = srv.post(
        "/generate",
        json={"text": open_end, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    ).json()
    assert cont["choices"][0]["message"]["content"] == native["text"]
    sep = srv.post("/v1/chat/completions", json={**body, "separate_reasoning": False})
    assert (
        sep.status_code == 200
        and sep.json()["choices"][0]["message"]["content"]
        == (plain["choices"][0]["message"]["content"])
    )


# ---- 2, 3. lengths --------------------------------------------------------------------------


def test_chat_without_max_tokens_is_not_capped(srv):
    """No 128-token cap (SGLang generates up to the context): the stream is still going past
    128 tokens when the client leaves (which aborts it). Completions keep OpenAI's 16."""
    stream = _client(srv).chat.completions.create(
        model="tiny-mtp",
        messages=CHAT,
        stream=True,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    with stream:
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None
            tokens += len(chunk.choices[0].logprobs.content)
            if tokens > 130:
                break
    assert tokens > 130
    r = srv.post("/v1/completions", json={"model": "tiny-mtp", "prompt": "a", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
    srv.wait_idle()


def test_max_tokens_beyond_the_context_is_400_on_every_route(server):
    ctx = server.get("/model_info").json()["context_length"]
    cases = [
        ("/generate", {"text": "def f(", "sampling_params": {"max_new_tokens": ctx}}),
        ("/v1/completions", {"model": "tiny-mtp", "prompt": "def f(", "max_tokens": ctx}),
        ("/v1/chat/completions", {"model": "tiny-mtp", "messages": CHAT, "max_tokens": ctx}),
        (
            "/v1/chat/completions",
            {"model": "tiny-mtp", "messages": CHAT, "max_completion_tokens": ctx},
        ),
        ("/v1/responses", {"model": "tiny-mtp", "input": "def f(", "max_output_tokens": ctx}),
    ]
    for path, body in cases:
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"] if path in ("/generate", "/v1/responses") else r.json()
        assert TOO_LONG in err["message"] and f"of {ctx} tokens" in err["message"]
    with pytest.raises(openai.BadRequestError, match=TOO_LONG):
        _client(server).completions.create(model="tiny-mtp", prompt="a", max_tokens=ctx)


# ---- 4. cache_salt ----------------------------------------------------------------------------


def test_cache_salt_isolates_cached_prefixes(srv):
    text = _unique("The quick brown fox jumps over the lazy dog")
    client = _client(srv)

    def cached(salt: str, route: str) -> int:
        if route == "generate":
            body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}}
            return srv.post("/generate", json=body).json()["meta_info"]["cached_tokens"]
        if route == "chat":
            out = client.chat.completions.create(
                model="tiny-mtp",
                messages=[{"role": "user", "content": text}],
                max_tokens=1,
                extra_body={"cache_salt": salt},
            )
        else:
            out = client.completions.create(
                model="tiny-mtp", prompt=text, max_tokens=1, extra_body={"cache_salt": salt}
            )
        return out.usage.prompt_tokens_details.cached_tokens

    for route in ("completions", "chat", "generate"):
        a, b = f"{route}-tenant-a", f"{route}-tenant-b"
        assert cached(a, route) == 0
        assert cached(b, route) == 0  # the same prompt under another salt shares nothing
        assert cached(a, route) > 0  # within one salt the prefix is shared


# ---- 5. endpoints -----------------------------------------------------------------------------


def test_model_by_id(server):
    card = server.get("/v1/models").json()["data"][0]
    assert server.get(f"/v1/models/{card['id']}").json() == card
    assert _client(server).models.retrieve(card["id"]).max_model_len == card["max_model_len"]
    r = server.get("/v1/models/no-such-model")
    assert r.status_code == 404
    assert r.json() == {
        "object": "error",
        "message": "The model 'no-such-model' does not exist",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


def test_responses_create_stream_retrieve_and_follow_up(srv):
    client = _client(srv)
    call = dict(model="tiny-mtp", max_output_tokens=6, temperature=0, instructions="Write Python.")
    first = client.responses.create(input="def f(", **call)
    assert (first.status == "incomplete") == (first.usage.output_tokens == 6)
    native = srv.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-mtp",
            "messages": [
                {"role": "system", "content": "Write Python."},
                {"role": "user", "content": "def f("},
            ],
            "max_tokens": 6,
            "temperature": 0,
        },
    ).json()
    assert first.output_text == native["choices"][0]["message"]["content"]

    events = list(client.responses.create(input="def f(", stream=True, **call))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == first.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text) == (first.id, first.output_text)
    follow = client.responses.create(input="again", previous_response_id=first.id, **call)
    assert follow.previous_response_id == first.id
    # The follow-up's prompt holds the first turn: its input and its output.
    turn = first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens > turn
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(input="x", previous_response_id="resp_missing", **call)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    tool = {"type": "function", "name": "f", "parameters": {}}
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.responses.create(input="x", tools=[tool], **call)


def test_score_is_the_label_probability(srv, tokenizer):
    query, items, labels = "def f(x):\n    return ", ["x", "x + 1"], [87, 88, 89]
    body = {"model": "tiny-mtp", "query": query, "items": items, "label_token_ids": labels}
    scores = srv.post("/v1/score", json=body).json()["scores"]
    soft = srv.post("/v1/score", json={**body, "apply_softmax": True}).json()["scores"]
    for item, row, soft_row in zip(items, scores, soft):
        ids = tokenizer.encode(query + item)
        for label, score in zip(labels, row):
            out = srv.post(
                "/generate",
                json={
                    "input_ids": ids + [label],
                    "return_logprob": True,
                    "logprob_start_len": len(ids),
                    "sampling_params": {"max_new_tokens": 0},
                },
            ).json()
            logprob = out["meta_info"]["input_token_logprobs"][-1][0]
            assert score == pytest.approx(math.exp(logprob), rel=1e-4)
        assert soft_row == pytest.approx([s / sum(row) for s in row], rel=1e-4)
    first = srv.post("/v1/score", json={**body, "item_first": True}).json()["scores"]
    assert first != scores
    bad = srv.post("/v1/score", json={**body, "label_token_ids": [10**9]})
    assert bad.status_code == 400 and "out of vocabulary" in bad.json()["message"]


# ---- 6. echo + logprobs, stop_token_ids -------------------------------------------------------


def test_echo_with_logprobs_returns_the_prompt_logprobs(srv):
    body = {"model": "tiny-mtp", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
    out = srv.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
    choice, usage = out["choices"][0], out["usage"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None
    native = srv.post(
        "/generate",
        json={
            "text": "def f(x):",
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    ).json()["meta_info"]
    expect = [e[0] for e in native["input_token_logprobs"] + native["output_token_logprobs"]]
    assert lp["token_logprobs"][1:] == pytest.approx(expect[1:], abs=1e-5)
    assert choice["text"].startswith("def f(x):")
    _assert_offsets_point_at_tokens(choice["text"], lp)


def _assert_offsets_point_at_tokens(text: str, lp: dict) -> None:
    """OpenAI's text_offset: each token's position in the choice's text (the BOS, which the
    echoed text leaves out, at 0)."""
    assert lp["tokens"][0] == "<|bos|>" and lp["text_offset"][0] == 0
    for tok, off in zip(lp["tokens"][1:], lp["text_offset"][1:]):
        assert text[off : off + len(tok)] == tok, (text, lp["tokens"], lp["text_offset"])


def test_echo_with_logprobs_streams_the_prompt_first(server):
    body = {"model": "tiny-mtp", "prompt": "x = ", "max_tokens": 3, "echo": True, "logprobs": 0}
    body["temperature"] = 0
    r = server.post("/v1/completions", json={**body, "stream": True}, stream=True)
    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("x = ") and first["logprobs"]["token_logprobs"][0] is None
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks)
    usage = server.post("/v1/completions", json=body).json()["usage"]
    assert tokens == usage["prompt_tokens"] + usage["completion_tokens"]
    streamed = {
        key: [x for c in chunks for x in c["choices"][0]["logprobs"][key]]
        for key in ("tokens", "text_offset")
    }
    _assert_offsets_point_at_tokens("".join(c["choices"][0]["text"] for c in chunks), streamed)


def test_a_matched_stop_token_is_trimmed_from_the_text(srv, tokenizer):
    """SGLang's detokenizer leaves a matched stop token out of the text unless no_stop_trim
    (output_ids and completion_tokens keep it), streamed or not, on every route."""
    prompt = _unique("def f(")
    sp = {"max_new_tokens": 6, "temperature": 0}
    ids = srv.post("/generate", json={"text": prompt, "sampling_params": sp}).json()["output_ids"]
    stop_id = ids[2]
    k = ids.index(stop_id)
    trimmed, kept = tokenizer.decode(ids[:k]), tokenizer.decode(ids[: k + 1])
    assert trimmed != kept
    sp["stop_token_ids"] = [stop_id]
    out = srv.post("/generate", json={"text": prompt, "sampling_params": sp}).json()
    assert (out["text"], out["output_ids"]) == (trimmed, ids[: k + 1])
    sp["no_stop_trim"] = True
    out = srv.post("/generate", json={"text": prompt, "sampling_params": sp}).json()
    assert out["text"] == kept
    body = {"model": "tiny-mtp", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    body["stop_token_ids"] = [stop_id]
    out = srv.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == trimmed and out["usage"]["completion_tokens"] == k + 1
    r = srv.post("/v1/completions", json={**body, "stream": True}, stream=True)
    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == trimmed


def test_streamed_chunks_add_up_to_the_text_a_stop_string_trims(srv, tokenizer):
    """The start of a stop string is held back until it cannot complete, so a stream never
    sends text the final (trimmed) output leaves out."""
    prompt = _unique("def f(")
    sp = {"max_new_tokens": 8, "temperature": 0}
    ids = srv.post("/generate", json={"text": prompt, "sampling_params": sp}).json()["output_ids"]
    stop = tokenizer.decode(ids[1:3])  # spans two tokens: its first arrives a step early
    body = {
        "model": "tiny-mtp",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stop": [stop],
    }
    whole = srv.post("/v1/completions", json=body).json()["choices"][0]["text"]
    r = srv.post("/v1/completions", json={**body, "stream": True}, stream=True)
    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    native = {"text": prompt, "sampling_params": {**sp, "stop": stop}, "stream": True}
    r = srv.post("/generate", json=native, stream=True)
    texts = [json.loads(x[6:])["text"] for x in r.iter_lines() if x.startswith(b"data: {")]
    assert all(whole.startswith(t) for t in texts) and texts[-1] == whole


def test_streamed_logprobs_survive_a_held_back_stop_prefix(srv, tokenizer):
    """A step whose text is held back (it could begin a stop string) sends no chunk; its
    tokens' logprob entries come with the next one, at their offsets in the text: the streamed
    entries add up to the non-streamed ones."""
    prompt = _unique("def f(")
    sp = {"max_new_tokens": 8, "temperature": 0}
    ids = srv.post("/generate", json={"text": prompt, "sampling_params": sp}).json()["output_ids"]
    stop = tokenizer.decode(ids[1:2]) + "QQQZZZ"  # begins like the second token, never completes
    body = {
        "model": "tiny-mtp",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stop": [stop],
    }
    body["logprobs"] = 1
    whole = srv.post("/v1/completions", json=body).json()["choices"][0]
    r = srv.post("/v1/completions", json={**body, "stream": True}, stream=True)
    chunks = [json.loads(x[6:])["choices"][0] for x in r.iter_lines() if x.startswith(b"data: {")]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
        assert streamed == whole["logprobs"][key], key

    chat = {"model": "tiny-mtp", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    chat.update(temperature=0, logprobs=True)
    first = srv.post("/v1/chat/completions", json=chat).json()["choices"][0]
    chat["stop"] = [first["logprobs"]["content"][1]["token"] + "QQQZZZ"]
    whole = srv.post("/v1/chat/completions", json=chat).json()["choices"][0]
    r = srv.post("/v1/chat/completions", json={**chat, "stream": True}, stream=True)
    chunks = [json.loads(x[6:])["choices"] for x in r.iter_lines() if x.startswith(b"data: {")]
    streamed = [e for c in chunks if c and c[0]["logprobs"] for e in c[0]["logprobs"]["content"]]
    assert streamed == whole["logprobs"]["content"]


def test_cached_tokens_count_each_prompt_once(server):
    """usage.prompt_tokens_details.cached_tokens counts a prompt's cache hit once, however
    many samples share it (SGLang's count), streamed or not: never above prompt_tokens."""
    body = {
        "model": "tiny-mtp",
        "prompt": [_unique("x ="), _unique("y =")],
        "max_tokens": 1,
        "n": 3,
    }
    server.post("/v1/completions", json=body)  # caches both prompts
    used = server.post("/v1/completions", json=body).json()["usage"]
    assert used["prompt_tokens_details"]["cached_tokens"] == used["prompt_tokens"] - 2
    r = server.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        stream=True,
    )
    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
    assert chunks[-1]["usage"] == used


def test_top_logprobs_of_many_samples_and_tokens(server):
    """8 samples of 160 tokens with 20 top logprobs each: every token of every sample has its
    entries (that a step's response costs only the new tokens' logprobs is
    tests/engine/test_logprob_responses.py's check)."""
    body = {"model": "tiny-mtp", "prompt": "a", "max_tokens": 160, "n": 8, "ignore_eos": True}
    out = server.post("/v1/completions", json={**body, "logprobs": 20}).json()
    assert len(out["choices"]) == 8
    for choice in out["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 160
        assert len(lp["top_logprobs"]) == 160
        # a top list names 20 tokens; two whose texts are alike share one key
        assert all(1 <= len(top) <= 20 for top in lp["top_logprobs"])
        assert all(x <= 0 for x in lp["token_logprobs"])


def test_out_of_vocab_stop_token_ids_are_accepted(server):
    for path, body in [
        (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [-1]}},
        ),
        (
            "/v1/completions",
            {"model": "tiny-mtp", "prompt": "a", "max_tokens": 2, "stop_token_ids": [10**9]},
        ),
    ]:
        r = server.post(path, json=body)
        assert r.status_code == 200, r.text


# ---- 7. log lines -----------------------------------------------------------------------------

DECODE_LINE = re.compile(
    r"Decode batch\. #running-req: \d+, #token: \d+, token usage: \d+\.\d\d, "
    r"(accept len: \d+\.\d\d, )?gen throughput \(token/s\): \d+\.\d\d, #queue-req: \d+"
)
PREFILL_LINE = re.compile(
    r"Prefill batch\. #new-seq: \d+, #new-token: \d+, #cached-token: \d+, "
    r"token usage: \d+\.\d\d, #running-req: \d+, #queue-req: \d+"
)


def test_sglang_scheduler_log_lines(srv):
    """At the default --decode-log-interval (40 steps): 150 tokens take at least 50 steps."""
    sp = {"max_new_tokens": 150, "ignore_eos": True}
    assert srv.post("/generate", json={"text": "a", "sampling_params": sp}).status_code == 200
    deadline = time.monotonic() + 10
    while not DECODE_LINE.search(srv.log()) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = srv.log()
    assert PREFILL_LINE.search(log)
    decode = DECODE_LINE.search(log)
    spec = srv.get("/server_info").json()["speculative_algorithm"] == "MTP"
    assert decode and ("accept len" in decode.group(0)) == spec
