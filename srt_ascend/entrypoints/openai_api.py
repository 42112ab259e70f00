"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each prompt (times `n`) becomes one runtime request. Streaming sends `data: {chunk}` with the
text delta of one choice, an optional usage chunk (`stream_options.include_usage`) and
`data: [DONE]`. Errors are SGLang's {"object": "error", "message", "type", "param", "code"}
(HTTP 400 for a bad request).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from srt_ascend.entrypoints.http_utils import (
    SSE_DONE,
    ORJSONResponse,
    json_body_spec,
    openai_error_body,
    read_json,
    sse,
)
from srt_ascend.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from srt_ascend.entrypoints.serving import Serving, until_disconnected
from srt_ascend.managers.tokenizer_manager import RequestError

OPENAI_BODY_MODELS = [CompletionRequest, ChatCompletionRequest, OpenAIError]


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validated request model; RequestError naming the first bad field otherwise. A
    top-level field the model does not have is refused unless it is null (clients may send
    nulls for SGLang fields they do not use), as /generate refuses what it does not support."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if model.model_config.get("extra") == "forbid":
        for key in [k for k in body if k not in model.model_fields]:
            if body[key] is not None:
                raise RequestError(f"{key} is not supported by this server")
            del body[key]
    try:
        obj = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise RequestError(f"{loc}: {err['msg']}") from e
    unsupported = getattr(obj, "unsupported", None)
    bad = unsupported() if unsupported is not None else None
    if bad is not None:
        raise RequestError(f"{bad} is not supported by this server")
    return obj


def map_finish(meta: dict) -> tuple[str | None, Any]:
    """OpenAI finish_reason ("stop", "length", "abort") and SGLang's matched_stop."""
    fr = meta["finish_reason"]
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def usage(prompt_tokens: int, outs: list[dict]) -> dict:
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Choice:
    """Streaming progress of one choice."""

    index: int
    sent_text: str = ""
    sent_logprobs: int = 0
    started: bool = False
    last: dict | None = field(default=None, repr=False)

    def advance(self, out: dict) -> tuple[str, int]:
        """(new text, logprob entries already sent) for a new cumulative output."""
        text = out["text"]
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        start = self.sent_logprobs
        self.sent_text, self.last = text, out
        self.sent_logprobs = len(out["meta_info"].get("output_token_logprobs", ()))
        return delta, start


class OpenAIServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.tm = serving.tm
        self.created = int(time.time())

    # ---- logprobs -----------------------------------------------------------------------------

    def _logprob_items(self, meta: dict, start: int) -> list[tuple[str, float, list]]:
        toks = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:] or [[] for _ in toks]
        texts = self.serving.token_texts([t[1] for t in toks])
        items = []
        for (lp, _), text, top in zip(toks, texts, tops):
            top_texts = self.serving.token_texts([t[1] for t in top])
            items.append((text, lp, [(tt, t[0]) for tt, t in zip(top_texts, top)]))
        return items

    def completion_logprobs(self, meta: dict, start: int, offset: int) -> dict:
        items = self._logprob_items(meta, start)
        offsets = []
        for text, _, _ in items:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": [t for t, _, _ in items],
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [dict(top) for _, _, top in items],
            "text_offset": offsets,
        }

    def chat_logprobs(self, meta: dict, start: int) -> dict:
        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**entry(text, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                for text, lp, top in self._logprob_items(meta, start)
            ]
        }

    # ---- requests -----------------------------------------------------------------------------

    def _requests(self, prompts: list[list[int]], obj, sp: dict, logprobs: int | None):
        total = len(prompts) * obj.n
        reqs = []
        for ids in prompts:
            for _ in range(obj.n):
                rid = obj.rid if obj.rid is None or total == 1 else f"{obj.rid}-{len(reqs)}"
                reqs.append(
                    self.serving.make_request(
                        ids,
                        sp,
                        rid=rid,
                        return_logprob=logprobs is not None,
                        top_logprobs_num=logprobs or 0,
                    )
                )
        self.serving.check_unique_rids(reqs)
        return reqs

    async def _completion_prompts(
        self, obj: CompletionRequest
    ) -> tuple[list[list[int]], list[str]]:
        """(token ids, text to echo) per prompt; token-id prompts are checked as /generate
        checks them, then echo their decoded text."""
        p = obj.prompt
        if isinstance(p, str):
            texts = [p]
        elif not p:
            raise RequestError("prompt must not be empty")
        elif all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            ids = [list(p)] if all(isinstance(x, int) for x in p) else [list(x) for x in p]
            for x in ids:
                self.tm.validate_input_ids(x)
            dec = self.tm.tokenizer.decode
            return ids, [dec(x, skip_special_tokens=True) for x in ids]
        return [await self.tm.tokenize_async(t) for t in texts], texts

    async def chat_prompt(self, obj: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tm.tokenizer, "chat_template", None):
            raise RequestError("the model's tokenizer has no chat template")
        messages = [{"role": m.role, "content": m.text()} for m in obj.messages]
        try:
            text = self.tm.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja raises its own errors for malformed conversations
            raise RequestError(f"the chat template failed on these messages: {e}") from e
        return await self.tm.tokenize_async(text)

    async def completions(self, request: Request):
        obj = parse_body(CompletionRequest, await read_json(request))
        prompts, prompt_texts = await self._completion_prompts(obj)
        self.serving.admit(len(prompts) * obj.n)
        reqs = self._requests(prompts, obj, obj.sampling_params(obj.max_tokens), obj.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "model": obj.model}
        echo = [t if obj.echo else "" for t in prompt_texts]
        prompt_tokens = sum(len(ids) for ids in prompts)

        def choice(c: Choice, delta: str, lp_start: int, meta: dict) -> dict:
            prefix = echo[c.index // obj.n] if not c.started else ""
            fr, matched = map_finish(meta)
            lp = None
            if obj.logprobs is not None:
                lp = self.completion_logprobs(meta, lp_start, len(c.sent_text) - len(delta))
            return {
                "index": c.index,
                "text": prefix + delta,
                "logprobs": lp,
                "finish_reason": fr,
                "matched_stop": matched,
            }

        if obj.stream:
            return self._stream(reqs, head, prompt_tokens, obj.include_usage, choice)
        outs = await until_disconnected(request, self.serving.run_all(reqs))
        choices = []
        for i, o in enumerate(outs):
            c = Choice(i)
            delta, lp_start = c.advance(o)
            choices.append(choice(c, delta, lp_start, o["meta_info"]))
        return ORJSONResponse(
            {
                **head,
                "created": int(time.time()),
                "choices": choices,
                "usage": usage(prompt_tokens, outs),
            }
        )

    async def chat_completions(self, request: Request):
        obj = parse_body(ChatCompletionRequest, await read_json(request))
        ids = await self.chat_prompt(obj)
        self.serving.admit(obj.n)
        logprobs = (obj.top_logprobs or 0) if obj.logprobs else None
        reqs = self._requests([ids], obj, obj.sampling_params(obj.max_new_tokens), logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "model": obj.model}

        def chunk_choice(c: Choice, delta: str, lp_start: int, meta: dict) -> dict:
            fr, matched = map_finish(meta)
            d = {"content": delta} if delta else {}
            if not c.started:
                d = {"role": "assistant", "content": delta}
            lp = self.chat_logprobs(meta, lp_start) if obj.logprobs else None
            return {
                "index": c.index,
                "delta": d,
                "logprobs": lp,
                "finish_reason": fr,
                "matched_stop": matched,
            }

        if obj.stream:
            head["object"] = "chat.completion.chunk"
            return self._stream(reqs, head, len(ids), obj.include_usage, chunk_choice)
        outs = await until_disconnected(request, self.serving.run_all(reqs))
        choices = []
        for i, o in enumerate(outs):
            fr, matched = map_finish(o["meta_info"])
            choices.append(
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": o["text"],
                        "reasoning_content": None,
                        "tool_calls": None,
                    },
                    "logprobs": self.chat_logprobs(o["meta_info"], 0) if obj.logprobs else None,
                    "finish_reason": fr,
                    "matched_stop": matched,
                }
            )
        return ORJSONResponse(
            {
                **head,
                "created": int(time.time()),
                "choices": choices,
                "usage": usage(len(ids), outs),
            }
        )

    def _stream(
        self,
        reqs,
        head: dict,
        prompt_tokens: int,
        include_usage: bool,
        make_choice: Callable[[Choice, str, int, dict], dict],
    ) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            choices = [Choice(i) for i in range(len(reqs))]
            created = int(time.time())
            try:
                async for i, out in self.serving.stream_all(reqs):
                    c = choices[i]
                    delta, lp_start = c.advance(out)
                    finished = out["meta_info"]["finish_reason"] is not None
                    if not delta and not finished and c.started:
                        continue
                    body = make_choice(c, delta, lp_start, out["meta_info"])
                    c.started = True
                    yield sse({**head, "created": created, "choices": [body], "usage": None})
            except RequestError as e:
                yield sse(openai_error_body(str(e)))
            else:
                if include_usage:
                    outs = [c.last for c in choices if c.last is not None]
                    yield sse(
                        {
                            **head,
                            "created": created,
                            "choices": [],
                            "usage": usage(prompt_tokens, outs),
                        }
                    )
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    def models(self) -> dict:
        name = self.serving.args.model_name
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "srt_ascend",
                    "root": name,
                    "max_model_len": self.tm.context_len,
                }
            ],
        }


def add_openai_routes(app: FastAPI, serving: Serving) -> None:
    api = OpenAIServing(serving)
    app.add_api_route("/v1/models", lambda: ORJSONResponse(api.models()), methods=["GET"])
    app.add_api_route(
        "/v1/completions",
        api.completions,
        methods=["POST"],
        openapi_extra=json_body_spec(CompletionRequest, OpenAIError),
    )
    app.add_api_route(
        "/v1/chat/completions",
        api.chat_completions,
        methods=["POST"],
        openapi_extra=json_body_spec(ChatCompletionRequest, OpenAIError),
    )
