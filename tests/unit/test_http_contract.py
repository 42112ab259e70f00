"""The HTTP layer's pure parts: the API-key decision (SGLang's rules), the OpenAPI models kept
in step with the validators, Content-Type matching and the new server flags."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from srt_ascend.entrypoints.auth import admin_allowed, is_authorized
from srt_ascend.entrypoints.generate_input import (
    IGNORED_SAMPLING,
    RENAMED_SAMPLING,
    GenerateReqInput,
    GenerateRequest,
    SamplingParamsBody,
    clean_sampling_params,
    parallel_samples,
    refuse_unsupported_fields,
)
from srt_ascend.entrypoints.http_utils import is_json_type, parse_body
from srt_ascend.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from srt_ascend.managers.tokenizer_manager import RequestError
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs, prepare_server_args

K, A = "k", "a"


@pytest.mark.parametrize(
    "path, header, api_key, admin_key, allowed",
    [
        ("/generate", None, None, None, True),
        ("/generate", None, K, None, False),
        ("/generate", "Bearer k", K, None, True),
        ("/generate", "bearer k", K, None, True),
        ("/generate", "Basic k", K, None, False),
        ("/generate", "Bearer a", K, A, False),
        ("/v1/models", "Bearer x", K, None, False),
        ("/health", None, K, A, True),
        ("/health_generate", None, K, A, True),
        ("/metrics", None, K, A, True),
        ("/flush_cache", "Bearer k", K, A, False),
        ("/flush_cache", "Bearer a", K, A, True),
        ("/flush_cache", "Bearer k", K, None, True),
        ("/flush_cache", None, None, A, False),
        ("/generate", None, None, A, True),  # admin key only: normal endpoints stay open
        # /abort_request: either key passes; the route asks admin_allowed for abort_all
        ("/abort_request", "Bearer a", K, A, True),
        ("/abort_request", "Bearer k", K, A, True),
        ("/abort_request", None, K, A, False),
        ("/abort_request", None, None, A, True),
    ],
)
def test_api_key_decision(path, header, api_key, admin_key, allowed):
    assert is_authorized(path, "POST", header, api_key, admin_key) is allowed


@pytest.mark.parametrize(
    "header, api_key, admin_key, allowed",
    [
        (None, None, None, True),
        (None, None, A, False),
        ("Bearer k", K, A, False),
        ("Bearer a", K, A, True),
        ("Bearer k", K, None, True),
        (None, K, None, False),
    ],
)
def test_admin_operations_need_the_admin_key_when_one_is_set(header, api_key, admin_key, allowed):
    assert admin_allowed(header, api_key, admin_key) is allowed


def test_options_is_always_allowed():
    assert is_authorized("/generate", "OPTIONS", None, K, A)


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready", "/metrics"])
def test_probes_are_open_with_both_keys_set(path):
    assert is_authorized(path, "GET", None, K, A)
    assert not is_authorized("/get_server_info", "GET", None, K, A)


@pytest.mark.parametrize(
    "ctype, ok",
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/vnd.api+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        (None, False),
    ],
)
def test_json_content_types(ctype, ok):
    assert is_json_type(ctype) is ok


def test_generate_schema_lists_what_the_validator_reads():
    body = {name: None for name in GenerateRequest.model_fields}
    body["text"] = "a"
    body["stream"] = body["return_text_in_logprobs"] = False
    GenerateReqInput.from_json(body)  # every documented field is accepted
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    documented = set(SamplingParamsBody.model_fields)
    assert documented == known | set(IGNORED_SAMPLING) | set(RENAMED_SAMPLING)


def test_openai_routes_refuse_unknown_fields_by_name():
    base = {"model": "m", "prompt": "a"}
    with pytest.raises(RequestError, match="regexp is not supported by this server"):
        parse_body(CompletionRequest, {**base, "regexp": "[a-z]+"})
    assert parse_body(CompletionRequest, {**base, "regexp": None}).prompt == "a"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi", "extra": 1}]}
    assert parse_body(ChatCompletionRequest, {**chat, "tool_choice": "none"}).n == 1
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_body(CompletionRequest, [1])


def test_chat_takes_openais_fields_that_ask_nothing_and_refuses_the_others_by_name():
    """What the openai client may send on chat: storage and routing metadata, a reasoning
    budget, a prediction, text modalities are taken (as SGLang takes them); legacy function
    calling, audio and web search would change the answer and are refused naming the field."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    taken = {
        "store": False,
        "metadata": {"team": "a"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "reasoning_effort": "low",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "x"},
        "modalities": ["text"],
        "function_call": "none",
    }
    request = parse_body(ChatCompletionRequest, {**chat, **taken})
    assert request.sampling_params(8) == parse_body(ChatCompletionRequest, chat).sampling_params(8)
    refused = {
        "functions": [{"name": "f", "parameters": {}}],
        "function_call": {"name": "f"},
        "audio": {"voice": "alloy", "format": "wav"},
        "web_search_options": {"search_context_size": "low"},
        "modalities": ["text", "audio"],
    }
    for name, value in refused.items():
        with pytest.raises(RequestError, match=f"^{name} is not supported") as e:
            parse_body(ChatCompletionRequest, {**chat, name: value})
        assert e.value.param == name


def _decision(check, *args) -> str:
    """ "ok", or the message of the RequestError `check(*args)` raises."""
    try:
        check(*args)
    except RequestError as e:
        return str(e)
    return "ok"


EXTENSIONS = {
    "regex": "[0-9]+",
    "json_schema": '{"type": "object"}',
    "ebnf": 'root ::= "a"',
    "stop_regex": "[.]",
    "logit_bias": {"5": -100.0},
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "ignore_eos": True,
    "no_stop_trim": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "stop_token_ids": [3],
}


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_openai_extension_fields_map_to_generate_sampling_params(name):
    """Each SGLang extension field reaches /generate's sampling-parameter check under its
    /generate name, so both routes accept or refuse it alike (the 400 names the field)."""
    value = EXTENSIONS[name]
    body = parse_body(CompletionRequest, {"model": "m", "prompt": "a", name: value})
    sp = body.sampling_params(16)
    assert sp[name] == value
    native = _decision(clean_sampling_params, {name: value})
    openai = _decision(clean_sampling_params, sp, "")
    assert openai == native.replace("sampling_params.", "")


@pytest.mark.parametrize(
    "fmt, schema",
    [
        ({"type": "json_object"}, {"type": "object"}),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string"}}},
            {"type": "string"},
        ),
        ({"type": "json_schema", "schema": {"type": "integer"}}, {"type": "integer"}),  # SGLang's
        ({"type": "text"}, None),
    ],
)
def test_response_format_becomes_a_grammar(fmt, schema):
    """SGLang's mapping, on chat and completions alike: json_object -> any JSON object,
    json_schema -> its schema."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, {"prompt": "a"})):
        sp = parse_body(model, {**body, "response_format": fmt}).sampling_params(4)
        assert (json.loads(sp["json_schema"]) if "json_schema" in sp else None) == schema


def test_malformed_chat_bodies_are_refused_as_sglang_refuses_them():
    """A json_schema response_format without its schema, and a user message without
    content, are 400s (SGLang's checks), not an unconstrained or empty-turn generation."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    no_schema = {"type": "json_schema", "json_schema": {"name": "n"}}
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, {"prompt": "a"})):
        with pytest.raises(RequestError, match="schema_ is required"):
            parse_body(model, {**body, "response_format": no_schema})
    with pytest.raises(RequestError, match="^messages.0: .*a user message needs content"):
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user"}]})
    assistant = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert parse_body(ChatCompletionRequest, {"messages": assistant}).messages[1].text() == ""


def test_min_tokens_and_request_fields_map_like_generate():
    body = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "min_tokens": 3,
            "lora_path": "adapter",
        },
    )
    assert body.sampling_params(8)["min_new_tokens"] == 3
    with pytest.raises(RequestError, match="^lora_path is not supported"):
        refuse_unsupported_fields(body.request_fields())
    with pytest.raises(RequestError, match="^lora_path is not supported"):
        GenerateReqInput.from_json({"text": "a", "lora_path": "adapter"})


def test_hardening_flags():
    args = prepare_server_args(
        [
            "--api-key",
            "k",
            "--admin-api-key",
            "a",
            "--max-queued-requests",
            "3",
            "--max-request-body-mb",
            "0.5",
            "--shutdown-timeout",
            "7",
        ]
    )
    assert (args.api_key, args.admin_api_key, args.max_queued_requests) == ("k", "a", 3)
    assert args.max_request_body_bytes == 512 * 1024 and args.shutdown_timeout == 7
    defaults = ServerArgs()
    assert defaults.api_key is None and defaults.max_queued_requests is None
    for bad in ({"max_queued_requests": -1}, {"shutdown_timeout": -1}, {"api_key": ""}):
        with pytest.raises(ValueError):
            ServerArgs(**bad)


def test_sglang_logging_and_metrics_flags():
    args = prepare_server_args(
        ["--decode-log-interval", "5", "--enable-metrics", "--enable-cache-report"]
    )
    assert (args.decode_log_interval, args.enable_metrics, args.enable_cache_report) == (
        5,
        True,
        True,
    )
    assert ServerArgs().decode_log_interval == 40  # SGLang's default
    with pytest.raises(ValueError, match="--decode-log-interval"):
        ServerArgs(decode_log_interval=0).check()


def test_parallel_samples_get_their_own_seeds():
    """n > 1 with a seed: sample j of each prompt is seeded seed + j (mod 2**64, vLLM's rule),
    so the samples differ, sample 0 is the n = 1 request, and the derivation is reproducible;
    without a seed nothing is added."""
    body = {
        "input_ids": [[1, 2], [3]],
        "sampling_params": {"temperature": 1.0, "seed": 7, "n": 3},
        "rid": ["p", "q"],
    }
    items = asyncio.run(GenerateReqInput.from_json(body).items(None))
    assert [(it.rid, it.input_ids, it.sampling_params["seed"]) for it in items] == [
        ("p-0", [1, 2], 7),
        ("p-1", [1, 2], 8),
        ("p-2", [1, 2], 9),
        ("q-0", [3], 7),
        ("q-1", [3], 8),
        ("q-2", [3], 9),
    ]
    assert all(it.sampling_params["temperature"] == 1.0 for it in items)
    assert [s["seed"] for s in parallel_samples({"seed": 2**64 - 1}, 2)] == [2**64 - 1, 0]
    assert parallel_samples({"temperature": 1.0}, 2) == [{"temperature": 1.0}] * 2
    assert parallel_samples({"seed": "x"}, 2) == [{"seed": "x"}] * 2  # refused later, by name
    for sp in parallel_samples({"seed": 7}, 2):
        SamplingParams.from_dict(sp).verify(100)


def test_max_payload_size_is_the_body_bound_with_max_request_body_mb():
    """SGLang's --max-payload-size (bytes) and --max-request-body-mb are one bound: either
    sets it, both agreeing is fine, both differing is a one-line start error."""
    assert prepare_server_args(["--max-payload-size", "1000"]).max_request_body_bytes == 1000
    same = ["--max-payload-size", str(2 << 20), "--max-request-body-mb", "2"]
    assert prepare_server_args(same).max_request_body_bytes == 2 << 20
    assert ServerArgs().max_request_body_bytes == 32 << 20
    with pytest.raises(ValueError, match="--max-payload-size 1000 and --max-request-body-mb 2 "):
        ServerArgs(max_payload_size=1000, max_request_body_mb=2.0)
    with pytest.raises(ValueError, match="--max-payload-size must be >= 1"):
        ServerArgs(max_payload_size=0)


def test_max_tokenize_tokens_flag():
    assert prepare_server_args(["--max-tokenize-tokens", "64"]).max_tokenize_tokens == 64
    assert ServerArgs().max_tokenize_tokens is None  # the context length
    with pytest.raises(ValueError, match="--max-tokenize-tokens must be >= 1"):
        ServerArgs(max_tokenize_tokens=0)
