"""OpenAI request bodies (the fields SGLang's OpenAI server takes), as pydantic models.

A top-level field this server does not implement is refused (HTTP 400 naming it, as `/generate`
refuses SGLang features it lacks) unless it is null; wrong types fail validation (HTTP 400).
`sampling_params()` maps a request onto SGLang sampling parameters. The models also describe
the request bodies in the served `/openapi.json`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from srt_ascend.managers.io_struct import MAX_TOP_LOGPROBS


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What completions and chat share, including SGLang's extra sampling fields."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        sp = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "seed": self.seed,
        }
        return {k: v for k, v in sp.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> str | None:
        """The name of a set field this server cannot honour, else None."""
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.echo and self.logprobs is not None:
            return "echo with logprobs"
        return super().unsupported()


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "auto" with no tools is "none"
    parallel_tool_calls: bool | None = None  # meaningful only with tools
    response_format: ResponseFormat | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format is not None and self.response_format.type != "text":
            return f"response_format {self.response_format.type!r}"
        return super().unsupported()


class OpenAIError(BaseModel):
    """SGLang's error body on /v1/* (HTTP 4xx/5xx)."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int
