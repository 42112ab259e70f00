"""Prefill-decode disaggregation behind sglang-router 0.3.2 (`--pd-disaggregation`), on CPU
with Mooncake's transfer engine over TCP (disagg_pairs.py): one prefill and one decode server,
MTP off and K = 2, against one colocated server (conftest's `server`, float32 like them).
Greedy outputs are token-identical on /generate, /v1/completions and /v1/chat/completions,
streaming or not; logprobs and seeded samples agree; the decode server never computes a prompt
and its MTP decode starts with verify steps; the transfer metrics count. Failures (bad
bootstrap fields, aborts, hung and killed peers): test_disaggregation_faults.py."""

from __future__ import annotations

import json

import pytest
import requests
from disagg_pairs import (
    GREEDY,
    LOGPROB_TOL,
    PROMPTS,
    _assert_matches_colocated,
    _generate,
    _openai,
    _prefills,
    _same_history,
    _wait_settled,
)


@pytest.mark.parametrize("stream", [False, True])
def test_generate_matches_colocated(server, pair, stream):
    _assert_matches_colocated(server, pair, stream)


def test_one_token_and_chunked_prompts_match_colocated(server, pair):
    """A request whose first token is its last (it finishes on the prefill server and is
    still sent: the decode server commits it and stops), and a prompt longer than
    --chunked-prefill-size (1024: prefilled in two chunks, sent once complete)."""
    long_prompt = PROMPTS[3] * 26
    for text, n in ((PROMPTS[0], 1), (long_prompt, 8)):
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
        got, want = _generate(pair.router, body), _generate(server.url, body)
        assert want["meta_info"]["prompt_tokens"] > 1024 or n == 1
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == n
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    _wait_settled(pair.prefill, pair.decode)


def test_parallel_samples_and_batches_match_colocated(server, pair):
    """n > 1 and batches through the router: it sends one room for a prompt's n samples
    (/generate, /v1/completions), one per prompt for a batch, one per choice for chat with
    n > 1; both servers give each generation its own room alike (room + i, as SGLang spreads
    it), so each is one KV transfer: greedy and seeded answers as one server's."""
    greedy = {"temperature": 0, "max_new_tokens": 8}
    for body, stream in (
        ({"text": PROMPTS[0], "sampling_params": {**greedy, "n": 2}}, False),
        ({"text": PROMPTS[1], "sampling_params": {**greedy, "n": 2}}, True),
        ({"input_ids": [[5, 6, 7], [8, 9, 10, 11]], "sampling_params": greedy}, False),
    ):
        got, want = (
            _generate_all(pair.router, body, stream),
            _generate_all(server.url, body, stream),
        )
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want] and len(got) == 2
    # seeded sampling as the colocated server's (MTP off; with MTP only greedy repeats it)
    temperature = 0 if "MTP" in pair.prefill_cmd else 0.8
    seeded = {"model": "tiny-mtp", "max_tokens": 8, "temperature": temperature, "seed": 11, "n": 3}
    chat = {**seeded, "n": 2, "messages": [{"role": "user", "content": PROMPTS[2]}]}
    # each body twice, compared the second time: the first computes the prompt whole on both
    # sides (one server prefills an n > 1 prompt once for its samples, the pair per sample)
    _same_history(server, pair.prefill, pair.decode)
    for route, body in (
        ("/v1/completions", {**seeded, "prompt": PROMPTS[0]}),
        ("/v1/chat/completions", chat),
    ):
        for _ in range(2):
            got = requests.post(pair.router + route, json=body, timeout=120)
            assert got.status_code == 200, got.text
            want = requests.post(server.url + route, json=body, timeout=120).json()
        assert got.json()["choices"] == want["choices"]
    _wait_settled(pair.prefill, pair.decode)


def _generate_all(url: str, body: dict, stream: bool) -> list[dict]:
    """A /generate answer with several generations (the last event of each when streaming)."""
    r = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    last = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            last[event["index"]] = event
    return [last[i] for i in sorted(last)]


def test_prefill_radix_hits_reach_the_client(plain_pair):
    """The prefill server's radix cache serves a repeated prompt; the decode server reports
    its hit as the request's cached_tokens."""
    body = {"text": PROMPTS[2] + " # again", "sampling_params": GREEDY}
    first = _generate(plain_pair.router, body)
    second = _generate(plain_pair.router, body)
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 1
    # tenants: another extra_key (/generate) or cache_salt (/v1/completions; the router drops
    # cache_salt from /generate) does not hit that cache, its own does
    other = _generate(plain_pair.router, {**body, "extra_key": "tenant-b"})["meta_info"]
    assert other["cached_tokens"] <= 1
    salted = {"model": "tiny-mtp", "prompt": body["text"], "max_tokens": 2, "cache_salt": "c"}
    for want_hit in (False, True):
        r = requests.post(plain_pair.router + "/v1/completions", json=salted, timeout=60)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 1) == want_hit, r.text


def test_openai_routes_match_colocated(server, pair):
    for stream in (False, True):
        for prompt in PROMPTS[:2]:
            body = {"model": "tiny-mtp", "prompt": prompt, "max_tokens": 20, "temperature": 0}
            assert _openai(pair.router, "/v1/completions", body, stream) == _openai(
                server.url, "/v1/completions", body, stream
            )
            chat = {
                "model": "tiny-mtp",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 20,
                "temperature": 0,
            }
            assert _openai(pair.router, "/v1/chat/completions", chat, stream) == _openai(
                server.url, "/v1/chat/completions", chat, stream
            )


def _close(got: list, want: list) -> None:
    """Logprob lists ([logprob, id, text] entries, nested lists of them, None) alike: ids
    equal, logprobs within LOGPROB_TOL."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g == w
        elif isinstance(w[0], list):
            _close(g, w)
        else:
            assert g[1:] == w[1:]
            assert (g[0] is None) == (w[0] is None)
            if w[0] is not None:
                assert abs(g[0] - w[0]) <= LOGPROB_TOL, (g, w)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_match_colocated(server, pair, stream):
    """Output and prompt logprobs as one server reports them, streaming or not (the
    prompt's come from the prefill server through the decode server's answer)."""
    body = {
        "text": PROMPTS[2],
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
        "token_ids_logprob": [10, 201],
    }
    got = _generate(pair.router, body, stream)["meta_info"]
    want = _generate(server.url, body, stream)["meta_info"]
    for key in (
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "input_token_ids_logprobs",
    ):
        _close(got[key], want[key])


def test_seeded_sampling_matches_colocated(server, plain_pair):
    """The first token is drawn on the prefill server, the rest on the decode server, each
    from the request's seeded stream at its output length, as on one server."""
    sp = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234, "max_new_tokens": 20}
    _same_history(server, plain_pair.prefill, plain_pair.decode)
    for prompt in PROMPTS[:2]:
        body = {"text": prompt, "sampling_params": sp}
        got = _generate(plain_pair.router, body)["output_ids"]
        assert got == _generate(server.url, body)["output_ids"]


def test_mtp_seeded_sampling_matches_colocated_mtp(mtp_server, mtp_pair):
    """Sampled drafts: d_1's distribution travels with it (the acceptance rule reads it at
    the decode server's first verify step), so seeded MTP sampling repeats a colocated MTP
    server's tokens (K=2 on all three; target logits alike in expand and fia)."""
    # hot enough that a draft's own probability is far from 1: read as one-hot (its
    # distribution lost on the way), the first step's acceptance would differ
    sp = {"temperature": 1.5, "sampling_seed": 77, "max_new_tokens": 16}
    _same_history(mtp_server, mtp_pair.prefill, mtp_pair.decode)
    for prompt in PROMPTS + [p + "\n" for p in PROMPTS]:
        body = {"text": prompt, "sampling_params": sp}
        got = _generate(mtp_pair.router, body)["output_ids"]
        assert got == _generate(mtp_server.url, body)["output_ids"], prompt


def test_mtp_decode_starts_with_verify_steps(mtp_pair):
    before = mtp_pair.decode.internal_state()["spec_num_verify"]
    decode_prefills = _prefills(mtp_pair.decode)
    _generate(mtp_pair.router, {"text": PROMPTS[0], "sampling_params": GREEDY})
    st = mtp_pair.decode.internal_state()
    assert st["spec_num_verify"] > before and st["avg_spec_accept_length"] > 1.0
    assert _prefills(mtp_pair.decode) == decode_prefills


def test_transfer_metrics(plain_pair):
    _generate(plain_pair.router, {"text": PROMPTS[3], "sampling_params": GREEDY})
    assert plain_pair.prefill.metric("sglang:kv_transfer_bytes_total") > 0
    assert plain_pair.prefill.metric("sglang:kv_transfer_seconds_total") > 0
    assert plain_pair.prefill.metric("sglang:kv_transfer_failures_total") == 0
