"""OpenAI-compatible routes: /v1/models(/{model}), /v1/completions, /v1/chat/completions
(the Responses and scoring APIs are in openai_responses.py and openai_score.py).

Each prompt (times `n`) becomes one runtime request, built from the same sampling-parameter dict
and request fields as a /generate body and checked by the same code, so a field is honoured or
refused (400 naming it) alike on every route. Without `max_tokens` a chat request (and a
completion with `max_tokens: null`) may generate up to the context length, as in SGLang.
Streaming sends `data: {chunk}` with the text delta of one choice (with
`stream_options.continuous_usage_stats`, also that choice's usage so far), an optional usage
chunk (`stream_options.include_usage`) and `data: [DONE]`. Errors are SGLang's {"object": "error",
"message", "type", "param", "code"} (HTTP 400 for a bad request, also for a `model` this server
does not serve, `Serving.check_model`; 404 for an unknown model on /v1/models/{model}).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from srt_ascend.entrypoints.generate_input import (
    BOOTSTRAP_KEYS,
    bootstraps_of,
    clean_sampling_params,
    extra_key,
    parallel_samples,
    refuse_unsupported_fields,
)
from srt_ascend.entrypoints.http_utils import (
    SSE_DONE,
    HTTPStatusError,
    ORJSONResponse,
    json_body_spec,
    openai_error_body,
    parse_body,
    read_json,
    sse,
)
from srt_ascend.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from srt_ascend.entrypoints.openai_responses import (
    ResponsesError,
    ResponsesRequest,
    ResponsesServing,
)
from srt_ascend.entrypoints.openai_score import ScoreRequest, ScoreServing
from srt_ascend.entrypoints.openai_tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    TokenizeServing,
)
from srt_ascend.entrypoints.serving import Serving, until_disconnected
from srt_ascend.managers.tokenizer_manager import RequestError

OPENAI_BODY_MODELS = [
    CompletionRequest,
    ChatCompletionRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    DetokenizeRequest,
    OpenAIError,
    ResponsesError,
]


def map_finish(meta: dict) -> tuple[str | None, Any]:
    """OpenAI finish_reason ("stop", "length", "abort") and SGLang's matched_stop."""
    fr = meta["finish_reason"]
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def usage(prompt_tokens: int, outs: list[dict], n: int = 1) -> dict:
    """OpenAI's usage of `outs` (prompt-major, `n` samples per prompt): completion tokens of
    every sample; cached tokens, like the prompt's, once per prompt (its first sample's, as
    SGLang counts them), so they never exceed prompt_tokens."""
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs[::n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True)
class LogprobToken:
    id: int
    text: str  # decoded on its own (U+FFFD for a part of a character)
    logprob: float | None  # None: the first prompt token


@dataclass
class Choice:
    """Streaming progress of one choice."""

    index: int
    sent_text: str = ""
    sent_logprobs: int = 0
    logprob_offset: int = 0  # where the next output token to send a logprob of begins, in text
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

    def _logprob_items(
        self, meta: dict, start: int, kind: str = "output"
    ) -> list[tuple[LogprobToken, list[LogprobToken]]]:
        """(token, its top list) of the output tokens from `start`, or of the prompt tokens
        (kind "input"; the first prompt token's logprob is None)."""
        toks = meta.get(f"{kind}_token_logprobs", [])[start:]
        tops = meta.get(f"{kind}_top_logprobs", [])[start:] or [[] for _ in toks]
        texts = self.serving.token_texts([t[1] for t in toks])
        items = []
        for (lp, tid), text, top in zip(toks, texts, tops):
            top = top or []
            top_texts = self.serving.token_texts([t[1] for t in top])
            entries = [LogprobToken(t[1], tt, t[0]) for tt, t in zip(top_texts, top)]
            items.append((LogprobToken(tid, text, lp), entries))
        return items

    def completion_logprobs(
        self, meta: dict, start: int, offset: int, prompt: bool
    ) -> tuple[dict, int]:
        """OpenAI's completion logprobs of the output tokens from `start`, after the prompt's
        tokens when `prompt` (echo). A token that is part of a character is named by its
        bytes, one latin-1 character each (SGLang's). `text_offset` is each token's position
        in the choice's text: the output tokens from `start` begin at `offset`, the prompt's
        at 0, a special token the echoed text leaves out (BOS) taking no width. Also returns
        where the next output token begins."""
        items, offsets = [], []
        if prompt:
            items = self._logprob_items(meta, 0, "input")
            special = set(self.tm.tokenizer.all_special_ids)
            pos = 0
            for tok, _ in items:
                offsets.append(pos)
                pos += 0 if tok.id in special else len(tok.text)
        outputs = self._logprob_items(meta, start)
        for tok, _ in outputs:
            offsets.append(offset)
            offset += len(tok.text)
        items += outputs
        name = self.serving.token_bytes.text_of
        return {
            "tokens": [name(tok.id, tok.text) for tok, _ in items],
            "token_logprobs": [tok.logprob for tok, _ in items],
            "top_logprobs": [{name(t.id, t.text): t.logprob for t in top} for _, top in items],
            "text_offset": offsets,
        }, offset

    def chat_logprobs(self, meta: dict, start: int) -> dict:
        """OpenAI's chat logprobs; `bytes` are each token's own (a character split over
        tokens joins from them), as SGLang reports them."""
        token_bytes = self.serving.token_bytes

        def entry(tok: LogprobToken) -> dict:
            raw = token_bytes.bytes_of(tok.id, tok.text)
            return {"token": tok.text, "logprob": tok.logprob, "bytes": raw}

        return {
            "content": [
                {**entry(tok), "top_logprobs": [entry(t) for t in top]}
                for tok, top in self._logprob_items(meta, start)
            ]
        }

    # ---- requests -----------------------------------------------------------------------------

    def _requests(
        self,
        prompts: list[list[int]],
        obj,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: bool = False,
    ):
        """`n` runtime requests per prompt (a seed becomes one per sample, as on /generate),
        checked as /generate checks its body. Without `max_tokens` each may generate up to
        the context length."""
        refuse_unsupported_fields(obj.request_fields())
        sp = clean_sampling_params(obj.sampling_params(max_tokens), prefix="")
        key = extra_key(obj.cache_salt, obj.extra_key)
        fields = obj.model_dump(include=set(BOOTSTRAP_KEYS))
        bootstraps = bootstraps_of(fields, len(prompts), obj.n)
        total = len(prompts) * obj.n
        reqs = []
        for ids in prompts:
            if max_tokens is None:
                sp = {**sp, "max_new_tokens": self.tm.max_new_tokens_left(len(ids))}
            for sample in parallel_samples(sp, obj.n):
                rid = obj.rid if obj.rid is None or total == 1 else f"{obj.rid}-{len(reqs)}"
                reqs.append(
                    self.serving.make_request(
                        ids,
                        sample,
                        bool(getattr(obj, "stream", False)),
                        rid=rid,
                        return_logprob=logprobs is not None,
                        logprob_start_len=0 if prompt_logprobs else None,
                        top_logprobs_num=logprobs or 0,
                        extra_key=key,
                        bootstrap=None if bootstraps is None else bootstraps[len(reqs)],
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
            return ids, await self.tm.off_loop(self._check_and_decode, ids)
        return [await self.tm.tokenize_async(t) for t in texts], texts

    def _check_and_decode(self, prompts: list[list[int]]) -> list[str]:
        """The echo text of token-id prompts, once they are checked as /generate checks them
        (time linear in the ids: run off the event loop)."""
        for ids in prompts:
            self.tm.validate_input_ids(ids)
        return [self.tm.tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts]

    async def chat_prompt(self, obj: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in obj.messages]
        return await self.chat_ids(messages, obj.continue_final_message, obj.chat_template_kwargs)

    async def chat_ids(
        self,
        messages: list[dict],
        continue_final: bool = False,
        template_kwargs: dict | None = None,
        generation_prompt: bool | None = None,
    ) -> list[int]:
        """The chat template over `messages`, tokenized: with a generation prompt for the
        assistant's turn, or (continue_final, last message the assistant's) open at the end
        of that message so the output continues it; `generation_prompt` True / False
        overrides that choice of a generation prompt (/v1/tokenize's add_generation_prompt)."""
        if not getattr(self.tm.tokenizer, "chat_template", None):
            raise RequestError("the model's tokenizer has no chat template")
        if "chat_template" in (template_kwargs or {}):  # every route refuses it before this
            raise RequestError("chat_template_kwargs.chat_template is not supported by this server")
        cont = continue_final and messages[-1]["role"] == "assistant"
        prompt = not cont if generation_prompt is None else generation_prompt

        def render() -> str:
            return self.tm.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=prompt,
                continue_final_message=cont,
                **(template_kwargs or {}),
            )

        try:  # the model's own template (a request's is refused), rendered off the event loop
            text = await self.tm.off_loop(render)
        except Exception as e:  # jinja raises its own errors for malformed conversations
            raise RequestError(f"the chat template failed on these messages: {e}") from e
        return await self.tm.tokenize_async(text)

    async def completions(self, request: Request):
        body = await read_json(request)
        self.refuse_oversized(body, "prompt")
        obj = parse_body(CompletionRequest, body)
        self.serving.check_model(obj.model)
        self.serving.check_prompt_count(num_prompts(obj.prompt) * obj.n)  # before tokenizing
        prompts, prompt_texts = await self._completion_prompts(obj)
        self.serving.admit(len(prompts) * obj.n)
        with_prompt_lp = obj.echo and obj.logprobs is not None
        reqs = self._requests(prompts, obj, obj.max_tokens, obj.logprobs, with_prompt_lp)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "model": obj.model}
        echo = [t if obj.echo else "" for t in prompt_texts]
        prompt_tokens = sum(len(ids) for ids in prompts)

        def choice(c: Choice, delta: str, lp_start: int, meta: dict) -> dict:
            prefix = echo[c.index // obj.n] if not c.started else ""
            fr, matched = map_finish(meta)
            lp = None
            if obj.logprobs is not None:
                first = with_prompt_lp and not c.started
                echoed = len(echo[c.index // obj.n])
                lp, end = self.completion_logprobs(meta, lp_start, echoed + c.logprob_offset, first)
                c.logprob_offset = end - echoed
            return {
                "index": c.index,
                "text": prefix + delta,
                "logprobs": lp,
                "finish_reason": fr,
                "matched_stop": matched,
            }

        if obj.stream:
            await self.serving.attach_grammars(reqs)  # a bad grammar: 400, not a stream
            return self._stream(reqs, head, prompt_tokens, obj, choice)
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
                "usage": usage(prompt_tokens, outs, obj.n),
            }
        )

    def _check_max_completion_tokens(self, obj: ChatCompletionRequest) -> None:
        """SGLang's chat check, before templating: an output budget past the context length
        is refused with SGLang's words (within it, the prompt + output check applies)."""
        asked, ctx = obj.max_completion_tokens or obj.max_tokens, self.tm.context_len
        if asked and asked > ctx:
            raise RequestError(
                f"max_completion_tokens is too large: {asked}."
                f"This model supports at most {ctx} completion tokens.",
                param="max_completion_tokens" if obj.max_completion_tokens else "max_tokens",
            )

    def refuse_oversized(self, body: Any, field: str) -> None:
        """Before the body is validated (pydantic holds the event loop for time linear in the
        list): chat `messages` (each takes at least one token of the prompt) more than the
        tokenize bound (`tm.max_tokenize_tokens`), or a token-id `prompt` longer than the
        context length, cannot fit; RequestError (400)."""
        value = body.get(field) if isinstance(body, dict) else None
        if not isinstance(value, list) or not value:
            return
        if field == "messages":
            unit, limit = "messages", self.tm.max_tokenize_tokens
            bound = self.tm.tokenize_bound()
        elif isinstance(value[0], int):
            unit, limit = "tokens", self.tm.context_len
            bound = f"the model's context length ({limit} tokens)"
        else:
            return  # a batch of prompts: each is checked once parsed
        if len(value) > limit:
            raise RequestError(f"{field}: {len(value)} {unit} cannot fit {bound}")

    async def chat_completions(self, request: Request):
        body = await read_json(request)
        self.refuse_oversized(body, "messages")
        obj = parse_body(ChatCompletionRequest, body)
        self.serving.check_model(obj.model)
        self._check_max_completion_tokens(obj)
        ids = await self.chat_prompt(obj)
        self.serving.admit(obj.n)
        logprobs = (obj.top_logprobs or 0) if obj.logprobs else None
        reqs = self._requests([ids], obj, obj.max_new_tokens, logprobs)
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
            await self.serving.attach_grammars(reqs)  # a bad grammar: 400, not a stream
            return self._stream(reqs, head, len(ids), obj, chunk_choice)
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
                "usage": usage(len(ids), outs, obj.n),
            }
        )

    def _stream(
        self,
        reqs,
        head: dict,
        prompt_tokens: int,
        obj: CompletionRequest | ChatCompletionRequest,
        make_choice: Callable[[Choice, str, int, dict], dict],
    ) -> StreamingResponse:
        """Chunks as the outputs come; each carries its choice's usage so far with
        continuous_usage_stats, and a last chunk the whole usage with include_usage."""

        async def events() -> AsyncIterator[bytes]:
            choices = [Choice(i) for i in range(len(reqs))]
            created = int(time.time())
            try:
                async with contextlib.aclosing(self.serving.stream_all(reqs)) as outs:
                    async for i, out in outs:
                        c = choices[i]
                        delta, lp_start = c.advance(out)
                        finished = out["meta_info"]["finish_reason"] is not None
                        if not delta and not finished and c.started:
                            c.sent_logprobs = lp_start  # its entries go with the next chunk
                            continue
                        meta = out["meta_info"]
                        body = make_choice(c, delta, lp_start, meta)
                        c.started = True
                        used = usage(meta["prompt_tokens"], [out]) if obj.continuous_usage else None
                        yield sse({**head, "created": created, "choices": [body], "usage": used})
            except RequestError as e:
                yield sse(openai_error_body(str(e)))
            else:
                if obj.include_usage:
                    outs = [c.last for c in choices if c.last is not None]
                    yield sse(
                        {
                            **head,
                            "created": created,
                            "choices": [],
                            "usage": usage(prompt_tokens, outs, obj.n),
                        }
                    )
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    def model_card(self) -> dict:
        name = self.serving.args.model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "srt_ascend",
            "root": name,
            "max_model_len": self.tm.context_len,
        }

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model: str) -> ORJSONResponse:
        """GET /v1/models/{model}: the served model's card for any of its names
        (`Serving.model_names`); 404 for any other name."""
        card = self.model_card()
        if model not in self.serving.model_names:
            raise HTTPStatusError(404, f"The model '{model}' does not exist")
        return ORJSONResponse(card)


def add_openai_routes(app: FastAPI, serving: Serving) -> None:
    api = OpenAIServing(serving)
    app.add_api_route("/v1/models", lambda: ORJSONResponse(api.models()), methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
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
    responses = ResponsesServing(serving, api.chat_ids)
    app.add_api_route(
        "/v1/responses",
        responses.create,
        methods=["POST"],
        openapi_extra=json_body_spec(ResponsesRequest, ResponsesError),
    )
    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route(
        "/v1/score",
        ScoreServing(serving).score,
        methods=["POST"],
        openapi_extra=json_body_spec(ScoreRequest, OpenAIError),
    )
    tokenize = TokenizeServing(serving, api)
    for name, handler, body in (
        ("tokenize", tokenize.tokenize, TokenizeRequest),
        ("detokenize", tokenize.detokenize, DetokenizeRequest),
    ):
        for path in (f"/v1/{name}", f"/{name}"):
            spec = json_body_spec(body, OpenAIError)
            app.add_api_route(path, handler, methods=["POST"], openapi_extra=spec)


def num_prompts(prompt) -> int:
    """The prompts in an OpenAI completion's `prompt`: a text or a token list is one, a list
    of texts or of token lists one each."""
    if isinstance(prompt, str) or not prompt or all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)
