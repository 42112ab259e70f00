"""SGLang's native HTTP API against the real server: /generate (single, batch, input_ids,
streaming, logprobs, rid, grammars), info endpoints, flush, health, abort and metrics."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "def fibonacci(n):\n"


def sse_events(resp) -> list:
    """The JSON payloads of an SSE response, then the literal "[DONE]"."""
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def test_ready_message_logged(server):
    deadline = time.monotonic() + 60
    while "The server is fired up and ready to roll!" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


def test_generate_text(server, tokenizer):
    r = server.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == 8
    assert 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["e2e_latency"] > 0
    # Greedy is deterministic, and input_ids give the same as the text they encode.
    again = server.post(
        "/generate", json={"input_ids": tokenizer.encode(PROMPT), "sampling_params": GREEDY}
    ).json()
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1


def test_generate_batch(server, tokenizer):
    prompts = ["import os\n", "class Stack:\n", PROMPT]
    params = [dict(GREEDY, max_new_tokens=n) for n in (2, 3, 4)]
    r = server.post(
        "/generate", json={"text": prompts, "sampling_params": params, "rid": ["b-0", "b-1", "b-2"]}
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b-0", "b-1", "b-2"]
    assert [len(o["output_ids"]) for o in outs] == [2, 3, 4]
    single = server.post("/generate", json={"text": PROMPT, "sampling_params": params[2]}).json()
    assert outs[2]["output_ids"] == single["output_ids"]
    ids = server.post(
        "/generate",
        json={"input_ids": [tokenizer.encode(p) for p in prompts], "sampling_params": params[0]},
    ).json()
    assert [o["output_ids"] for o in ids] == [o["output_ids"][:2] for o in outs]


def test_parallel_samples_share_the_prompt(server, tokenizer):
    """sampling_params.n: n samples per prompt, prompt-major, in a list even for one prompt;
    every sample finds the prompt in the radix cache."""
    prompts = ["import collections\nimport itertools\n", "class Queue:\n    def put"]
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 3}
    body = {"text": prompts, "sampling_params": sampled, "rid": ["p", "q"]}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["p-0", "p-1", "p-2", "q-0", "q-1", "q-2"]
    assert all(len(o["output_ids"]) == 6 for o in outs)
    for i, o in enumerate(outs):
        prompt_len = len(tokenizer.encode(prompts[i // 3]))
        assert o["meta_info"]["cached_tokens"] >= prompt_len - 2, o["meta_info"]
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1  # samples, not copies
    greedy = {**GREEDY, "n": 2}
    two = server.post("/generate", json={"text": PROMPT, "sampling_params": greedy}).json()
    one = server.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    assert [o["output_ids"] for o in two] == [one["output_ids"]] * 2
    r = server.post(
        "/generate", json={"text": PROMPT, "sampling_params": greedy, "stream": True}, stream=True
    )
    finals = [c for c in sse_events(r)[:-1] if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]
    assert all(c["output_ids"] == one["output_ids"] for c in finals)


def test_generate_stream_is_cumulative(server):
    final = server.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    r = server.post(
        "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}, stream=True
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 8
    for i, c in enumerate(chunks):
        assert c["output_ids"] == final["output_ids"][: i + 1]
        assert final["text"].startswith(c["text"].rstrip("\ufffd"))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 7
    assert chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


CALL_REGEX = r"[a-z_]{1,8}\((n|[0-9]{1,2})\)"
GRAMMARS = {
    "regex": CALL_REGEX,
    # a JSON value without whitespace inside (the tiny model fills an object's with newlines;
    # tests/engine covers objects, compact)
    "json_schema": json.dumps({"type": "string", "pattern": "^[a-z]{2,8}$"}),
    "ebnf": 'root ::= "yes" | "no" | "maybe"',
}


def test_generate_under_grammars(server):
    """Each grammar kind in one batch beside an unconstrained request; streamed alike."""
    kinds = list(GRAMMARS)
    params = [{"max_new_tokens": 48, "temperature": 0, k: GRAMMARS[k]} for k in kinds]
    body = {"text": [PROMPT] * 4, "sampling_params": [*params, GREEDY]}
    outs = server.post("/generate", json=body).json()
    texts = dict(zip(kinds, (o["text"] for o in outs)))
    assert re.fullmatch(CALL_REGEX, texts["regex"]), texts
    assert re.fullmatch("[a-z]{2,8}", json.loads(texts["json_schema"])), texts
    assert texts["ebnf"] in ("yes", "no", "maybe")
    for o in outs[:3]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    assert (
        outs[3]["output_ids"]
        == server.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()[
            "output_ids"
        ]
    )
    r = server.post("/generate", json={**body, "stream": True}, stream=True)
    finals = {}
    for c in sse_events(r)[:-1]:
        if c["meta_info"]["finish_reason"] is not None:
            finals[c["index"]] = c["text"]
    assert [finals[i] for i in range(4)] == [o["text"] for o in outs]


def test_generate_stream_batch_has_index(server):
    r = server.post(
        "/generate",
        json={
            "text": ["a", "b"],
            "stream": True,
            "sampling_params": dict(GREEDY, max_new_tokens=3),
        },
        stream=True,
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    per_index = {0: [], 1: []}
    for e in events[:-1]:
        per_index[e["index"]].append(e)
    assert [len(v) for v in per_index.values()] == [3, 3]
    assert all(v[-1]["meta_info"]["completion_tokens"] == 3 for v in per_index.values())


def test_logprobs(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {
        "input_ids": ids,
        "sampling_params": dict(GREEDY, max_new_tokens=4),
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 3,
    }
    meta = server.post("/generate", json=body).json()["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inp] == ids[1:]
    assert len(outp) == 4 and len(meta["output_top_logprobs"]) == 4
    for (lp, tid, text), top in zip(outp, meta["output_top_logprobs"]):
        assert text is None and lp <= 0 and math.isfinite(lp)
        assert len(top) == 3
        # Greedy: the sampled token is the most likely one.
        assert tid == top[0][1] and lp == pytest.approx(top[0][0], abs=1e-4)
        assert top[0][0] >= top[1][0] >= top[2][0]
    with_text = server.post("/generate", json={**body, "return_text_in_logprobs": True}).json()
    entries = with_text["meta_info"]["output_token_logprobs"]
    assert [e[2] for e in entries] == [tokenizer.decode([e[1]]) for e in entries]
    first_inp = with_text["meta_info"]["input_token_logprobs"][0]
    assert first_inp[2] == tokenizer.decode([ids[1]])


def test_logprob_start_len_bounds_as_sglang(server, tokenizer):
    """SGLang 0.5.23's prompt logprobs: by default (or -1) none, only the output's; from a
    start up to the prompt's length (the length itself: none); past it a 400. Every reported
    list has prompt_tokens - start entries."""
    ids = tokenizer.encode(PROMPT)
    base = {"input_ids": ids, "sampling_params": dict(GREEDY, max_new_tokens=2)}
    base |= {"return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [5]}
    for start in (None, -1, len(ids), len(ids) - 1, 1):
        body = base if start is None else {**base, "logprob_start_len": start}
        r = server.post("/generate", json=body)
        assert r.status_code == 200, (start, r.text)
        meta = r.json()["meta_info"]
        want = 0 if start in (None, -1) else len(ids) - start
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            assert len(meta[key]) == want, (start, key, meta[key])
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[len(ids) - want :]
        assert len(meta["output_token_logprobs"]) == 2
    r = server.post("/generate", json={**base, "logprob_start_len": len(ids) + 1})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


def test_token_ids_logprob(server, tokenizer):
    """SGLang's token_ids_logprob: at every reported position, [logprob, id, text] for each
    asked id in the asked order; the values agree with the top lists where they overlap."""
    ids = tokenizer.encode(PROMPT)
    body = {
        "input_ids": ids,
        "sampling_params": dict(GREEDY, max_new_tokens=3),
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 20,
    }
    meta = server.post("/generate", json=body).json()["meta_info"]
    asked = [meta["output_top_logprobs"][0][0][1], 7, meta["output_top_logprobs"][1][3][1]]
    got = server.post("/generate", json={**body, "token_ids_logprob": asked}).json()["meta_info"]
    assert "output_token_ids_logprobs" not in meta
    assert len(got["input_token_ids_logprobs"]) == len(ids) - 2
    assert len(got["output_token_ids_logprobs"]) == 3
    for kind in ("input", "output"):
        for at, (entries, top) in enumerate(
            zip(got[f"{kind}_token_ids_logprobs"], got[f"{kind}_top_logprobs"])
        ):
            assert [e[1] for e in entries] == asked and all(e[2] is None for e in entries)
            top_of = {t[1]: t[0] for t in top}
            for lp, tid, _ in entries:
                assert lp <= 0 and math.isfinite(lp), (kind, at)
                if tid in top_of:
                    assert lp == pytest.approx(top_of[tid], abs=1e-5)
    # a batch: one list per prompt (or null)
    batch = {
        "input_ids": [ids, ids[:4]],
        "sampling_params": dict(GREEDY, max_new_tokens=2),
        "return_logprob": True,
        "token_ids_logprob": [[5, 6], None],
    }
    first, second = server.post("/generate", json=batch).json()
    assert [[e[1] for e in x] for x in first["meta_info"]["output_token_ids_logprobs"]] == [
        [5, 6],
        [5, 6],
    ]
    assert "output_token_ids_logprobs" not in second["meta_info"]


def test_max_new_tokens_zero_prefills_only(server, tokenizer):
    body = {
        "text": [PROMPT + "    return", PROMPT + "    pass"],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    }
    outs = server.post("/generate", json=body).json()
    for o in outs:
        assert o["output_ids"] == [] and o["text"] == ""
        inp = o["meta_info"]["input_token_logprobs"]
        assert inp[0][0] is None and all(e[0] < 0 for e in inp[1:])
        assert len(inp) == o["meta_info"]["prompt_tokens"]


def test_unknown_top_level_field_is_ignored(server):
    r = server.post(
        "/generate",
        json={
            "text": "a",
            "sampling_params": {"max_new_tokens": 1},
            "lora_path": None,
            "some_future_field": 1,
        },
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1


def test_model_info(server):
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["model_path"] == server.model_path
        assert info["tokenizer_path"] == server.model_path
        assert info["is_generation"] is True
        assert info["served_model_name"] == "tiny-mtp"


def test_server_info(server):
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["model_path"] == server.model_path and info["num_threads"] == 1
        assert info["max_total_tokens"] == 32768
        state = info["internal_states"][0]
        assert state["max_total_num_tokens"] == 32768
        assert 0 < state["available_kv_tokens"] <= 32768
        assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0
        assert "avg_spec_accept_length" in state
        assert state["avg_spec_accept_length"] is None  # MTP is off on this server


def test_flush_cache_frees_the_tree(server):
    server.post("/generate", json={"text": PROMPT * 3, "sampling_params": GREEDY})
    assert server.internal_state()["cached_tokens_in_tree"] > 0
    r = server.post("/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text
    state = server.internal_state()
    assert state["cached_tokens_in_tree"] == 0
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]


def test_health(server):
    assert server.get("/health").status_code == 200
    assert server.get("/ready").status_code == 200  # SGLang's readiness probe
    before = server.metric("sglang:num_requests_total")
    assert server.get("/health_generate").status_code == 200
    assert server.metric("sglang:num_requests_total") == before  # not a user request


def test_abort_request(server):
    body = {
        "text": PROMPT,
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0},
    }
    r = server.post("/generate", json=body, stream=True)
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith(b"data: "))
    assert json.loads(first[6:])["meta_info"]["id"] == "abort-me"
    assert server.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    rest = [
        json.loads(line[6:])
        for line in lines
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]
    last = rest[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort"
    assert last["completion_tokens"] < 3000
    server.wait_idle()


def test_metrics(server):
    before = {
        m: server.metric(m)
        for m in (
            "sglang:num_requests_total",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sglang:time_to_first_token_seconds_count",
            "sglang:e2e_request_latency_seconds_count",
            "sglang:time_per_output_token_seconds_count",
        )
    }
    out = server.post("/generate", json={"text": [PROMPT, "x = 1"], "sampling_params": GREEDY})
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in out.json())
    text = server.get("/metrics").text
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text
    assert "sglang:cache_hit_rate{" in text
    after = {m: server.metric(m) for m in before}
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 2
    assert (
        after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == prompt_tokens
    )
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 16
    for m in (
        "sglang:time_to_first_token_seconds_count",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:time_per_output_token_seconds_count",
    ):
        assert after[m] - before[m] == 2
    assert 0.0 <= server.metric("sglang:cache_hit_rate") <= 1.0
