"""OpenAI request bodies (the fields SGLang's OpenAI server takes), as pydantic models.

A top-level field this server does not know is refused (HTTP 400 naming it) unless it is null;
wrong types fail validation (HTTP 400); booleans must be JSON booleans (no "yes" or 1), as on
/generate. `sampling_params()` maps a request, SGLang's extension
fields included (`regex`, `json_schema`, `ebnf`, `stop_regex`, `logit_bias`, `response_format`,
`top_k`, `min_p`, ...), onto the sampling-parameter dict `/generate` takes, and `request_fields()`
onto its top-level request fields (`lora_path`, `custom_logit_processor`,
`return_hidden_states`), so each route accepts or refuses a field alike. The models also
describe the request bodies in the served `/openapi.json`.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from srt_ascend.managers.io_struct import MAX_TOP_LOGPROBS


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # every choice chunk carries its choice's usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format; SGLang turns it into a grammar sampling parameter."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _top_level_schema(cls, values):
        """SGLang also takes {"type": "json_schema", "schema": {...}} (no json_schema)."""
        if isinstance(values, dict) and values.get("type") == "json_schema":
            schema = values.get("schema")
            if not values.get("json_schema") and isinstance(schema, dict):
                name = schema.get("title", "Schema")
                rest = {k: v for k, v in values.items() if k != "schema"}
                return {**rest, "json_schema": {"name": name, "schema": schema}}
        return values

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError("schema_ is required for json_schema response format request.")
        return self

    def sampling_params(self) -> dict:
        """SGLang's mapping: json_object is any JSON object, json_schema its schema, a
        structural tag the format itself (as JSON strings)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        if self.type == "structural_tag":
            return {"structural_tag": json.dumps(self.model_dump(exclude_none=True))}
        return {}


class _SamplingFields(BaseModel):
    """What completions and chat share, including SGLang's extra sampling fields."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None  # SGLang's on completions too
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    speculative_num_steps: StrictInt | None = None  # MTP drafts per step for this request
    rid: str | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    # sglang-router --pd-disaggregation's (see /generate)
    # (one value, or a list: one per prompt or per choice)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: StrictInt | list[StrictInt] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None
    # SGLang request fields, checked as /generate checks them (generate_input.UNSUPPORTED_FIELDS)
    lora_path: str | list[str | None] | None = None
    custom_logit_processor: str | None = None
    return_hidden_states: StrictBool = False

    def request_fields(self) -> dict:
        """The fields that are top-level request fields on /generate."""
        return {
            "lora_path": self.lora_path,
            "custom_logit_processor": self.custom_logit_processor,
            "return_hidden_states": self.return_hidden_states,
        }

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        """/generate's sampling_params for this request (nulls dropped)."""
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
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "seed": self.seed,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
            "stop_regex": self.stop_regex,
            "logit_bias": self.logit_bias,
            "speculative_num_steps": self.speculative_num_steps,
        }
        if self.response_format is not None:
            sp.update(self.response_format.sampling_params())
        return {k: v for k, v in sp.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and SGLang's default; null: up to the context
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _user_content_given(self) -> ChatMessage:
        if self.role == "user" and self.content is None:  # SGLang's and OpenAI's schema
            raise ValueError("a user message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "auto" with no tools is "none"
    parallel_tool_calls: StrictBool | None = None  # meaningful only with tools
    continue_final_message: StrictBool = False  # extend the last (assistant) message, no new turn
    separate_reasoning: StrictBool = True  # no reasoning parser here: the content is all of it
    stream_reasoning: StrictBool = True  # (sglang-router sends both, at SGLang's defaults)
    chat_template_kwargs: dict | None = None
    # OpenAI's fields that ask nothing of generation here (SGLang ignores them too): storage
    # and billing metadata, cache routing hints, a reasoning budget (no reasoning parser), a
    # predicted output (a hint only)
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict | None = None
    modalities: list[str] | None = None  # text only
    # OpenAI's that would change the answer, refused by name (unsupported)
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    web_search_options: dict | None = None

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
        for name in ("functions", "audio", "web_search_options"):
            if getattr(self, name):
                return name
        if self.function_call not in (None, "none", "auto"):  # "auto" without functions: none
            return "function_call"
        if any(m != "text" for m in self.modalities or ()):
            return "modalities"
        if (self.chat_template_kwargs or {}).get("chat_template") is not None:
            # a template from the request would run arbitrary Jinja on the server
            return "chat_template_kwargs.chat_template"
        return None


class OpenAIError(BaseModel):
    """SGLang's error body on /v1/* (HTTP 4xx/5xx)."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int
