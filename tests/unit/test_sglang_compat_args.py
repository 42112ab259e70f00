"""SGLang compatibility of the request models, error shapes and flags (no server): the Responses
API's fields and error body, stream_options.continuous_usage_stats, --grammar-backend and
--enable-custom-logit-processor. The served behaviour is in tests/e2e/test_sglang_compat.py."""

from __future__ import annotations

import json

import pytest

from srt_ascend.entrypoints.http_utils import parse_body, route_error_response
from srt_ascend.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from srt_ascend.entrypoints.openai_responses import ResponsesError, ResponsesRequest
from srt_ascend.managers.tokenizer_manager import RequestError
from srt_ascend.server_args import ServerArgs, prepare_server_args


@pytest.mark.parametrize("truncation", ["disabled", "auto", None])
def test_responses_take_truncation_and_the_penalties(truncation):
    """SGLang accepts these (the openai client sends truncation); the penalties reach the
    sampling parameters under /generate's names."""
    body = {"input": "a", "frequency_penalty": 0.5, "presence_penalty": -0.25}
    obj = parse_body(ResponsesRequest, {**body, "truncation": truncation})
    assert obj.truncation == truncation
    sp = obj.sampling_params()
    assert (sp["frequency_penalty"], sp["presence_penalty"]) == (0.5, -0.25)


def test_responses_refusals_name_the_field():
    with pytest.raises(RequestError) as bad_value:
        parse_body(ResponsesRequest, {"input": "a", "truncation": "sometimes"})
    assert bad_value.value.param == "truncation"
    with pytest.raises(RequestError, match="^bogus is not supported") as unknown:
        parse_body(ResponsesRequest, {"input": "a", "bogus": 1})
    assert unknown.value.param == "bogus"
    with pytest.raises(RequestError) as tools:
        parse_body(ResponsesRequest, {"input": "a", "tools": [{"type": "function"}]})
    assert tools.value.param == "tools"


def test_error_shape_follows_the_route():
    """/v1/responses*: the Responses API's nested error; other /v1 routes: SGLang's OpenAI
    error; native routes: SGLang's native error."""
    body = json.loads(route_error_response("/v1/responses", "no", 400, "truncation").body)
    assert body == {
        "error": {
            "message": "no",
            "type": "invalid_request_error",
            "param": "truncation",
            "code": 400,
        }
    }
    ResponsesError.model_validate(body)  # what /openapi.json documents
    missing = json.loads(route_error_response("/v1/responses/resp_x", "gone", 404).body)
    assert missing["error"]["type"] == "invalid_request_error" and missing["error"]["code"] == 404
    busy = json.loads(route_error_response("/v1/responses", "busy", 503).body)
    assert busy["error"]["type"] == "Service Unavailable"
    chat = json.loads(route_error_response("/v1/chat/completions", "no", 400, "n").body)
    assert chat == {
        "object": "error",
        "message": "no",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert json.loads(route_error_response("/generate", "no").body) == {"error": {"message": "no"}}


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_continuous_usage_stats_is_read(model):
    base = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if model is ChatCompletionRequest
        else {"prompt": "a"}
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    obj = parse_body(model, {**base, "stream": True, "stream_options": options})
    assert obj.continuous_usage and obj.include_usage
    assert not parse_body(model, {**base, "stream": True}).continuous_usage
    plain = parse_body(model, {**base, "stream_options": {"include_usage": True}})
    assert plain.include_usage and not plain.continuous_usage


def test_grammar_backend_flag():
    assert prepare_server_args(["--grammar-backend", "xgrammar"]).grammar_backend == "xgrammar"
    assert ServerArgs().grammar_backend == "xgrammar"  # SGLang's default
    assert prepare_server_args(["--grammar-backend", "llguidance"]).grammar_backend == "llguidance"
    for other in ("outlines", "none"):
        with pytest.raises(ValueError, match=f"^--grammar-backend '{other}' is not available"):
            ServerArgs(grammar_backend=other)


def test_overlap_schedule_flags():
    """SGLang's flag and default: overlap scheduling on unless the flag is given, where the
    platform gains by it: devices, and compiled forwards on CPU (eager forwards there hold the
    GIL op by op: serial unless `--enable-overlap-schedule`). Both flags at once: an error."""
    from srt_ascend.platforms import get_platform

    assert not ServerArgs().disable_overlap_schedule
    assert not prepare_server_args([]).disable_overlap_schedule
    assert prepare_server_args(["--disable-overlap-schedule"]).disable_overlap_schedule
    assert prepare_server_args(["--enable-overlap-schedule"]).enable_overlap_schedule
    with pytest.raises(ValueError, match="^--enable-overlap-schedule and --disable-"):
        ServerArgs(enable_overlap_schedule=True, disable_overlap_schedule=True)
    cpu = get_platform("cpu")
    assert not cpu.overlaps_by_default(ServerArgs())
    assert cpu.overlaps_by_default(ServerArgs(enable_torch_compile=True))


def test_custom_logit_processor_flag_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        prepare_server_args(["--enable-custom-logit-processor"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error: --enable-custom-logit-processor is not supported" in lines[0]
    assert not ServerArgs().enable_custom_logit_processor
