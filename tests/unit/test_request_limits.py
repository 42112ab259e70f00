"""Request bounds checked before any work: `n` on /generate (64, as on /v1), the chat body's
strict booleans and refused user templates."""

from __future__ import annotations

import pytest

from srt_ascend.entrypoints.generate_input import MAX_PARALLEL_SAMPLES, GenerateReqInput
from srt_ascend.entrypoints.http_utils import parse_body
from srt_ascend.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from srt_ascend.managers.tokenizer_manager import RequestError

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("n", [0, MAX_PARALLEL_SAMPLES + 1, 20000, [1], "2", 2.0, True])
def test_generate_n_is_bounded_and_typed(n):
    with pytest.raises(RequestError, match=r"sampling_params.n must be an integer >= 1 and at"):
        GenerateReqInput.from_json({"text": "a", "sampling_params": {"n": n}})


def test_generate_n_up_to_the_bound():
    obj = GenerateReqInput.from_json(
        {"text": ["a", "b"], "sampling_params": {"n": MAX_PARALLEL_SAMPLES}}
    )
    assert obj.n == MAX_PARALLEL_SAMPLES and not obj.is_single


@pytest.mark.parametrize(
    "field, value",
    [
        ("continue_final_message", "yes"),
        ("continue_final_message", 1),
        ("stream", "false"),
        ("logprobs", "true"),
        ("ignore_eos", 0),
    ],
)
def test_chat_booleans_must_be_booleans(field, value):
    with pytest.raises(RequestError, match=f"{field}: Input should be a valid boolean"):
        parse_body(ChatCompletionRequest, {"messages": MESSAGES, field: value})


def test_completion_echo_must_be_a_boolean():
    with pytest.raises(RequestError, match="echo: Input should be a valid boolean"):
        parse_body(CompletionRequest, {"prompt": "a", "echo": "yes"})


def test_chat_refuses_a_template_from_the_request():
    body = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}
    with pytest.raises(RequestError, match="chat_template_kwargs.chat_template is not supported"):
        parse_body(ChatCompletionRequest, body)
    kwargs = {"enable_thinking": False, "chat_template": None}  # variables for the model's own
    obj = parse_body(ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert obj.chat_template_kwargs == kwargs
