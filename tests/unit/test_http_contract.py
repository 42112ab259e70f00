"""The HTTP layer's pure parts: the API-key decision (SGLang's rules), the OpenAPI models kept
in step with the validators, Content-Type matching and the new server flags."""

from __future__ import annotations

import dataclasses

import pytest

from srt_ascend.entrypoints.auth import is_authorized
from srt_ascend.entrypoints.generate_input import (
    IGNORED_SAMPLING,
    RENAMED_SAMPLING,
    GenerateReqInput,
    GenerateRequest,
    SamplingParamsBody,
)
from srt_ascend.entrypoints.http_utils import is_json_type
from srt_ascend.entrypoints.openai_api import parse_body
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
    ],
)
def test_api_key_decision(path, header, api_key, admin_key, allowed):
    assert is_authorized(path, "POST", header, api_key, admin_key) is allowed


def test_options_is_always_allowed():
    assert is_authorized("/generate", "OPTIONS", None, K, A)


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
    with pytest.raises(RequestError, match="regex is not supported by this server"):
        parse_body(CompletionRequest, {**base, "regex": "[a-z]+"})
    assert parse_body(CompletionRequest, {**base, "regex": None}).prompt == "a"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi", "extra": 1}]}
    with pytest.raises(RequestError, match="json_schema is not supported"):
        parse_body(ChatCompletionRequest, {**chat, "json_schema": "{}"})
    assert parse_body(ChatCompletionRequest, {**chat, "tool_choice": "none"}).n == 1
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_body(CompletionRequest, [1])


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
