"""SGLang's scoring API, `POST /v1/score`: for each item, the probability the model gives each of
`label_token_ids` as the next token after query + item (item + query with `item_first`).

Each item is one prompt-logprob request: the prompt followed by the first label, no output
token (`max_new_tokens` 0, `logprob_start_len` at the label), with `token_ids_logprob` = the
labels, so the logits at the prompt's last position give every label's logprob in one prefill.
Scores are exp(logprob), or a softmax over the labels' logprobs with `apply_softmax` (SGLang's
rule). A request takes at most MAX_SCORE_ITEMS items (HTTP 400 past it, before the body is
validated).
"""

from __future__ import annotations

import math

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from srt_ascend.entrypoints.http_utils import ORJSONResponse, parse_body, read_json
from srt_ascend.entrypoints.serving import Serving, until_disconnected
from srt_ascend.managers.tokenizer_manager import RequestError

MAX_SCORE_ITEMS = 1024  # items per request: each is a prefill of its own


class ScoreRequest(BaseModel):
    """`POST /v1/score` (SGLang's ScoringRequest): query and items both text or both token
    ids."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    query: str | list[int]
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = False
    item_first: bool = False


def label_scores(logprobs: list[float], apply_softmax: bool) -> list[float]:
    if not apply_softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    return [w / sum(weights) for w in weights]


class ScoreServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.tm = serving.tm

    async def _prompts(self, obj: ScoreRequest) -> list[list[int]]:
        """The token ids of query + item (or item + query) for every item."""
        items = [obj.items] if isinstance(obj.items, str) else obj.items
        if not items:
            raise RequestError("items must not be empty")
        if isinstance(obj.query, str) != all(isinstance(x, str) for x in items):
            raise RequestError("query and items must both be text or both token ids")
        if isinstance(obj.query, str):
            texts = [x + obj.query if obj.item_first else obj.query + x for x in items]
            return [await self.tm.tokenize_async(t) for t in texts]
        prompts = [x + obj.query if obj.item_first else obj.query + x for x in items]
        await self.tm.off_loop(self._check_ids, prompts)
        return prompts

    async def score(self, request: Request) -> ORJSONResponse:
        body = await read_json(request)
        items = body.get("items") if isinstance(body, dict) else None
        if isinstance(items, list) and len(items) > MAX_SCORE_ITEMS:
            raise RequestError(
                f"items: {len(items)} items; a request takes at most {MAX_SCORE_ITEMS}"
            )
        obj = parse_body(ScoreRequest, body)
        self.serving.check_model(obj.model)
        prompts = await self._prompts(obj)
        labels = obj.label_token_ids
        vocab = self.tm.runner.vocab_size
        if any(t < 0 for t in labels):
            raise RequestError("label_token_ids must contain nonnegative integers")
        for t in labels:
            if t >= vocab:  # SGLang's words
                raise RequestError(f"Token ID {t} is out of vocabulary (vocab size: {vocab})")
        self.serving.admit(len(prompts))
        reqs = await self.tm.off_loop(self._requests, prompts, labels)
        self.serving.check_unique_rids(reqs)
        outs = await until_disconnected(request, self.serving.run_all(reqs))
        scores = [
            label_scores(
                [e[0] for e in o["meta_info"]["input_token_ids_logprobs"][-1]], obj.apply_softmax
            )
            for o in outs
        ]
        prompt_tokens = sum(len(ids) for ids in prompts)
        return ORJSONResponse(
            {
                "object": "scoring",
                "model": obj.model,
                "scores": scores,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 0,
                    "total_tokens": prompt_tokens,
                },
            }
        )

    def _check_ids(self, prompts: list[list[int]]) -> None:
        """Token-id prompts checked as /generate checks them; one must hold a token (the
        label's logprob is read after its last one)."""
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"items[{i}]: query + item is empty: give at least one token")
            self.tm.validate_input_ids(ids)

    def _requests(self, prompts: list[list[int]], labels: list[int]) -> list:
        """One prefill per item (built off the event loop: time linear in the items): the
        first label completes the prompt, and the logits at the item's last position give
        every label's logprob (token_ids_logprob)."""
        return [
            self.serving.make_request(
                ids + labels[:1],
                {"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=len(ids),
                token_ids_logprob=labels,
            )
            for ids in prompts
        ]
