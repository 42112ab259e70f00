"""OpenAI's Responses API as SGLang serves it: `POST /v1/responses` (create, `stream` for its
server-sent events) and `GET /v1/responses/{id}` (retrieve a stored response).

A request's `input` (a text, or messages) follows `instructions` (a system message) and, with
`previous_response_id`, the earlier turns: that response's conversation (its inputs and its
output, not its instructions). The chat template turns the conversation into the prompt; the
sampling fields go through the same check as every other route. With `truncation: "auto"` a
conversation too long for the context loses its earliest turns (`"disabled"`, the default: the
request is refused, 400). Responses with `store` (the default) are kept in memory, the most
recent STORE_LIMIT of them within STORE_MAX_BYTES (response_store.py); `metadata` and `user`
are held to OpenAI's limits before the body is parsed (`check_openai_limits`). A response cut by
max_output_tokens is `incomplete` (OpenAI's; SGLang says completed); its usage carries SGLang's
prompt/completion token names beside OpenAI's. Errors have the Responses API's shape
(`ResponsesError`).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from srt_ascend.entrypoints.generate_input import clean_sampling_params, extra_key
from srt_ascend.entrypoints.http_utils import (
    SSE_DONE,
    HTTPStatusError,
    ORJSONResponse,
    parse_body,
    read_json,
    responses_error_body,
    sse,
)
from srt_ascend.entrypoints.response_store import ResponseStore
from srt_ascend.entrypoints.serving import Serving, until_disconnected
from srt_ascend.managers.tokenizer_manager import RequestError

ChatIds = Callable[[list[dict]], Awaitable[list[int]]]  # chat messages -> prompt token ids
# OpenAI's limits on a response's `metadata` (string keys and values) and `user`
METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
USER_MAX_CHARS = 64


def check_openai_limits(body: object) -> None:
    """OpenAI's bounds on `metadata` (at most 16 string keys of at most 64 characters, string
    values of at most 512) and `user` (at most 64 characters), checked on the raw body before
    it is validated or copied; RequestError (400) naming the field past them."""
    if not isinstance(body, dict):
        return
    metadata, user = body.get("metadata"), body.get("user")
    if isinstance(user, str) and len(user) > USER_MAX_CHARS:
        raise RequestError(
            f"Invalid 'user': string too long. Expected a string with maximum length "
            f"{USER_MAX_CHARS}, but got a string with length {len(user)} instead.",
            param="user",
        )
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise RequestError("metadata must be an object of strings", param="metadata")
    if len(metadata) > METADATA_MAX_KEYS:
        raise RequestError(
            f"Invalid 'metadata': too many properties. Expected an object with at most "
            f"{METADATA_MAX_KEYS} properties, but got an object with {len(metadata)} "
            "properties instead.",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise RequestError(
                f"Invalid 'metadata': a key is {len(key)} characters long; keys may have at "
                f"most {METADATA_MAX_KEY_CHARS}",
                param="metadata",
            )
        if not isinstance(value, str):
            raise RequestError(f"metadata.{key}: values must be strings", param="metadata")
        if len(value) > METADATA_MAX_VALUE_CHARS:
            raise RequestError(
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum "
                f"length {METADATA_MAX_VALUE_CHARS}, but got a string with length "
                f"{len(value)} instead.",
                param="metadata",
            )


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def chat_message(self) -> dict:
        text = self.content
        if not isinstance(text, str):
            text = "".join(p.text for p in text)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:  # OpenAI's: schema is required
            raise ValueError("a json_schema format needs its schema")
        return self


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesErrorDetail(BaseModel):
    message: str
    type: str  # "invalid_request_error" for a refused request
    param: str | None = None  # the request field at fault, where one is
    code: int  # the HTTP status


class ResponsesError(BaseModel):
    """The error body of /v1/responses (SGLang's, the Responses API's shape)."""

    error: ResponsesErrorDetail


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`; unknown fields are refused unless null, like every /v1 body."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    truncation: Literal["auto", "disabled"] | None = None  # None: "disabled"
    stream: bool = False
    store: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # OpenAI's limits: check_openai_limits
    user: str | None = None
    tool_choice: Literal["none", "auto"] = "auto"
    tools: list[dict] | None = None
    parallel_tool_calls: bool = True
    cache_salt: str | None = None

    def unsupported(self) -> str | None:
        return "tools" if self.tools else None  # no tool calling here

    def messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.chat_message() for m in self.input]

    def sampling_params(self) -> dict:
        sp = {
            "max_new_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        fmt = self.text.format if self.text else TextFormat()
        if fmt.type == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        elif fmt.type == "json_schema":
            sp["json_schema"] = json.dumps(fmt.schema_)
        return {k: v for k, v in sp.items() if v is not None}


class ResponsesServing:
    def __init__(self, serving: Serving, chat_ids: ChatIds) -> None:
        self.serving = serving
        self.chat_ids = chat_ids
        self.store = ResponseStore()

    def _conversation(self, obj: ResponsesRequest) -> list[dict]:
        """Earlier turns (from previous_response_id) followed by this input."""
        history: list[dict] = []
        if obj.previous_response_id is not None:
            stored = self.store.get(obj.previous_response_id)
            if stored is None:
                raise RequestError(
                    f"previous_response_id: no stored response {obj.previous_response_id!r}",
                    param="previous_response_id",
                )
            history = stored[1]
        return history + obj.messages()

    async def create(self, request: Request):
        body = await read_json(request)
        check_openai_limits(body)
        obj = parse_body(ResponsesRequest, body)
        self.serving.check_model(obj.model)
        ids, conversation = await self._prompt(obj, self._conversation(obj))
        sp = clean_sampling_params(obj.sampling_params(), prefix="")
        if obj.max_output_tokens is None:
            sp["max_new_tokens"] = self.serving.tm.max_new_tokens_left(len(ids))
        self.serving.admit(1)
        req = self.serving.make_request(
            ids, sp, bool(obj.stream), extra_key=extra_key(obj.cache_salt, None)
        )
        head = _response_head(obj)
        if obj.stream:
            events = self._events(req, head, obj, conversation)
            return StreamingResponse(events, media_type="text/event-stream")
        out = await until_disconnected(request, self.serving.run_to_end(req))
        return ORJSONResponse(self._finish(head, obj, conversation, out))

    async def _prompt(
        self, obj: ResponsesRequest, conversation: list[dict]
    ) -> tuple[list[int], list[dict]]:
        """(prompt token ids, the conversation they hold). With truncation "auto" a prompt that
        does not fit the context (with room for max_output_tokens) drops the fewest earliest
        turns that make it fit, cutting before a user message (the instructions stay); when
        none fits, or with "disabled", the whole conversation goes on (the length check then
        refuses it). The cut is found by bisection: O(log turns) tokenizations."""
        system = [{"role": "system", "content": obj.instructions}] if obj.instructions else []
        if obj.truncation == "auto":
            best = await self._fitting(system, conversation, obj)
            if best is None:
                cuts = [i for i, m in enumerate(conversation) if i > 0 and m["role"] == "user"]
                best = await self._earliest_fit(system, conversation, cuts, obj)
            if best is not None:
                return best
        return await self.chat_ids(system + conversation), conversation

    async def _earliest_fit(
        self, system: list[dict], conversation: list[dict], cuts: list[int], obj: ResponsesRequest
    ) -> tuple[list[int], list[dict]] | None:
        """The conversation from the earliest of `cuts` (ascending) on that fits, by bisection
        (a later cut keeps fewer tokens); None if none does."""
        best, lo, hi = None, 0, len(cuts) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            found = await self._fitting(system, conversation[cuts[mid] :], obj)
            if found is not None:
                best, hi = found, mid - 1
            else:
                lo = mid + 1
        return best

    async def _fitting(
        self, system: list[dict], kept: list[dict], obj: ResponsesRequest
    ) -> tuple[list[int], list[dict]] | None:
        """(token ids, kept) when system + kept fits the context, else None (also when the
        text is too long even to tokenize, or the template refuses that cut)."""
        try:
            ids = await self.chat_ids(system + kept)
        except RequestError:
            return None
        fits = len(ids) + (obj.max_output_tokens or 0) < self.serving.tm.context_len
        return (ids, kept) if fits else None

    def _finish(self, head: dict, obj: ResponsesRequest, conversation: list, out: dict) -> dict:
        """The completed response object (stored when `store`)."""
        meta = out["meta_info"]
        reason = (meta["finish_reason"] or {}).get("type")
        body = {
            **head,
            "status": "incomplete" if reason == "length" else "completed",
            "incomplete_details": ({"reason": "max_output_tokens"} if reason == "length" else None),
            "output": [_message(head["id"], out["text"], "completed")],
            "usage": _usage(
                meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]
            ),
        }
        if obj.store:
            turn = conversation + [{"role": "assistant", "content": out["text"]}]
            self.store.put(body["id"], body, turn)
        return body

    async def _events(
        self, req, head: dict, obj: ResponsesRequest, conversation: list
    ) -> AsyncIterator[bytes]:
        """The Responses API's event stream: created, in_progress, the output item and its
        text part opening, text deltas, their closing, completed."""
        seq = iter(range(1 << 62))
        item_id = _message(head["id"], "", "in_progress")["id"]
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **data) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **data})

        start = {**head, "status": "in_progress", "output": [], "usage": None}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        item = _message(head["id"], "", "in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.content_part.added", **at, part=_text_part(""))
        sent, last = "", None
        try:
            async with contextlib.aclosing(self.serving.stream_all([req])) as outs:
                async for _, out in outs:
                    last, text = out, out["text"]
                    if text.startswith(sent) and len(text) > len(sent):
                        yield event("response.output_text.delta", **at, delta=text[len(sent) :])
                        sent = text
        except RequestError as e:
            yield sse(responses_error_body(str(e), param=e.param))
            yield SSE_DONE
            return
        body = self._finish(head, obj, conversation, last)
        text = body["output"][0]["content"][0]["text"]
        yield event("response.output_text.done", **at, text=text, logprobs=[])
        yield event("response.content_part.done", **at, part=_text_part(text))
        yield event("response.output_item.done", output_index=0, item=body["output"][0])
        yield event("response.completed", response=body)
        yield SSE_DONE

    def retrieve(self, response_id: str) -> ORJSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise HTTPStatusError(
                404, f"Response with id '{response_id}' not found.", param="response_id"
            )
        return ORJSONResponse(stored[0])


def _response_head(obj: ResponsesRequest) -> dict:
    fmt = obj.text.format if obj.text else TextFormat()
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": obj.model,
        "error": None,
        "instructions": obj.instructions,
        "max_output_tokens": obj.max_output_tokens,
        "previous_response_id": obj.previous_response_id,
        "temperature": obj.temperature,
        "top_p": obj.top_p,
        "truncation": obj.truncation or "disabled",
        "parallel_tool_calls": obj.parallel_tool_calls,
        "tool_choice": obj.tool_choice,
        "tools": [],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "metadata": obj.metadata or {},
        "store": obj.store,
        "user": obj.user,
    }


def _usage(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI's Responses usage, and beside it SGLang's names for the same counts
    (`prompt_tokens`, `completion_tokens`), which SGLang's clients read."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message(response_id: str, text: str, status: str, content: list | None = None) -> dict:
    """The assistant message output item of a response (its id derives from the response's)."""
    return {
        "id": "msg_" + response_id.removeprefix("resp_"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)] if content is None else content,
    }
