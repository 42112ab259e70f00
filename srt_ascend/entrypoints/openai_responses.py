"""OpenAI's Responses API as SGLang serves it: `POST /v1/responses` (create, `stream` for its
server-sent events) and `GET /v1/responses/{id}` (retrieve a stored response).

A request's `input` (a text, or messages) follows `instructions` (a system message) and, with
`previous_response_id`, the earlier turns: that response's conversation (its inputs and its
output, not its instructions). The chat template turns the conversation into the prompt; the
sampling fields go through the same check as every other route. Responses with `store` (the
default) are kept in memory, the most recent STORE_LIMIT of them within STORE_MAX_BYTES
(response_store.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from srt_ascend.entrypoints.generate_input import clean_sampling_params, extra_key
from srt_ascend.entrypoints.http_utils import (
    SSE_DONE,
    HTTPStatusError,
    ORJSONResponse,
    openai_error_body,
    parse_body,
    read_json,
    sse,
)
from srt_ascend.entrypoints.response_store import ResponseStore
from srt_ascend.entrypoints.serving import Serving, until_disconnected
from srt_ascend.managers.tokenizer_manager import RequestError

ChatIds = Callable[[list[dict]], Awaitable[list[int]]]  # chat messages -> prompt token ids


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


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


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
    stream: bool = False
    store: bool = True
    text: TextConfig | None = None
    metadata: dict | None = None
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
        }
        fmt = self.text.format if self.text else TextFormat()
        if fmt.type == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        elif fmt.type == "json_schema":
            sp["json_schema"] = json.dumps(fmt.schema_ or {})
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
                    f"previous_response_id: no stored response {obj.previous_response_id!r}"
                )
            history = stored[1]
        return history + obj.messages()

    async def create(self, request: Request):
        obj = parse_body(ResponsesRequest, await read_json(request))
        conversation = self._conversation(obj)
        system = [{"role": "system", "content": obj.instructions}] if obj.instructions else []
        ids = await self.chat_ids(system + conversation)
        sp = clean_sampling_params(obj.sampling_params(), prefix="")
        if obj.max_output_tokens is None:
            sp["max_new_tokens"] = self.serving.tm.max_new_tokens_left(len(ids))
        self.serving.admit(1)
        req = self.serving.make_request(ids, sp, extra_key=extra_key(obj.cache_salt, None))
        head = _response_head(obj)
        if obj.stream:
            events = self._events(req, head, obj, conversation)
            return StreamingResponse(events, media_type="text/event-stream")
        out = await until_disconnected(request, self.serving.run_to_end(req))
        return ORJSONResponse(self._finish(head, obj, conversation, out))

    def _finish(self, head: dict, obj: ResponsesRequest, conversation: list, out: dict) -> dict:
        """The completed response object (stored when `store`)."""
        meta = out["meta_info"]
        reason = (meta["finish_reason"] or {}).get("type")
        body = {
            **head,
            "status": "incomplete" if reason == "length" else "completed",
            "incomplete_details": ({"reason": "max_output_tokens"} if reason == "length" else None),
            "output": [_message(head["id"], out["text"], "completed")],
            "usage": {
                "input_tokens": meta["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
                "output_tokens": meta["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
            },
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
            async for _, out in self.serving.stream_all([req]):
                last, text = out, out["text"]
                if text.startswith(sent) and len(text) > len(sent):
                    yield event("response.output_text.delta", **at, delta=text[len(sent) :])
                    sent = text
        except RequestError as e:
            yield sse(openai_error_body(str(e)))
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
            raise HTTPStatusError(404, f"no stored response with id {response_id!r}")
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
        "parallel_tool_calls": obj.parallel_tool_calls,
        "tool_choice": obj.tool_choice,
        "tools": [],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "metadata": obj.metadata or {},
        "store": obj.store,
        "user": obj.user,
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
