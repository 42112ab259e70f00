"""SGLang's (and vLLM's) tokenizer routes: `POST /v1/tokenize` (also `/tokenize`) and
`POST /v1/detokenize` (also `/detokenize`).

Tokenize takes a `prompt` (a text or a list of texts: ids per text) or chat `messages` (the ids
a chat completion over them would prompt with: the model's template, a generation prompt
unless `add_generation_prompt` says otherwise or the last assistant message is continued) and
answers {"tokens", "count", "max_model_len"}. Detokenize takes `tokens` (a list of ids, or a
list of such lists) and answers {"text"}. Both run in the tokenizer thread, and both are
bounded like a generation request: at most --max-prompts-per-request texts or lists, a text no
longer than could fit the context, a token list no longer than the context, ids inside the
vocabulary (HTTP 400 otherwise).
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from srt_ascend.entrypoints.http_utils import ORJSONResponse, parse_body, read_json
from srt_ascend.entrypoints.openai_protocol import ChatMessage
from srt_ascend.entrypoints.serving import Serving
from srt_ascend.managers.tokenizer_manager import RequestError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # with `prompt`: the tokenizer's BOS / EOS as it adds them
    add_generation_prompt: bool | None = None  # with `messages`; None: as a chat completion
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def unsupported(self) -> str | None:
        if (self.chat_template_kwargs or {}).get("chat_template") is not None:
            # a template from the request would run arbitrary Jinja on the server
            return "chat_template_kwargs.chat_template"
        return None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class TokenizeServing:
    def __init__(self, serving: Serving, api) -> None:
        """`api`: the OpenAIServing whose chat template rendering (`chat_ids`) and body checks
        (`refuse_oversized`) chat completions use."""
        self.serving, self.tm, self.api = serving, serving.tm, api

    async def tokenize(self, request: Request) -> ORJSONResponse:
        body = await read_json(request)
        self.api.refuse_oversized(body, "messages")  # before pydantic walks the lists
        prompts = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompts, list):
            self._check_count("prompt", len(prompts), "texts")
        obj = parse_body(TokenizeRequest, body)
        self.serving.check_model(obj.model)
        if (obj.prompt is None) == (obj.messages is None):
            raise RequestError("exactly one of 'prompt' or 'messages' must be given")
        if obj.messages is not None:
            if not obj.messages:
                raise RequestError("messages must not be empty")
            messages = [{"role": m.role, "content": m.text()} for m in obj.messages]
            ids = await self.api.chat_ids(
                messages,
                obj.continue_final_message,
                obj.chat_template_kwargs,
                obj.add_generation_prompt,
            )
            tokens, count = ids, len(ids)
        elif isinstance(obj.prompt, str):
            tokens = await self.tm.tokenize_async(obj.prompt, obj.add_special_tokens)
            count = len(tokens)
        else:
            tokens = [await self.tm.tokenize_async(t, obj.add_special_tokens) for t in obj.prompt]
            count = [len(t) for t in tokens]
        return ORJSONResponse(
            {"tokens": tokens, "count": count, "max_model_len": self.tm.context_len}
        )

    async def detokenize(self, request: Request) -> ORJSONResponse:
        body = await read_json(request)
        value = body.get("tokens") if isinstance(body, dict) else None
        if isinstance(value, list) and value:  # before pydantic walks the lists
            lists = value if isinstance(value[0], list) else [value]
            self._check_count("tokens", len(lists), "token lists")
            longest = max(len(x) if isinstance(x, list) else 0 for x in lists)
            if longest > self.tm.context_len:
                raise RequestError(
                    f"tokens: {longest} tokens cannot fit the model's context length "
                    f"({self.tm.context_len} tokens)"
                )
        obj = parse_body(DetokenizeRequest, body)
        self.serving.check_model(obj.model)
        nested = bool(obj.tokens) and isinstance(obj.tokens[0], list)
        lists = obj.tokens if nested else [obj.tokens]
        texts = await self.tm.off_loop(self._decode, lists, obj.skip_special_tokens)
        return ORJSONResponse({"text": texts if nested else texts[0]})

    def _check_count(self, field: str, n: int, unit: str) -> None:
        limit = self.tm.args.max_prompts_per_request
        if n > limit:
            raise RequestError(
                f"{field}: {n} {unit}; at most {limit} are allowed per request "
                "(--max-prompts-per-request)"
            )

    def _decode(self, lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        vocab = self.tm.runner.vocab_size
        if any(not 0 <= t < vocab for ids in lists for t in ids):
            raise RequestError(f"tokens must be integers in [0, {vocab})")
        decode = self.tm.tokenizer.decode
        return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in lists]
