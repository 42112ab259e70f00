"""The native `/generate` body (SGLang's GenerateReqInput), type-checked and split into items.

Contract (SGLang's): exactly one of `text` / `input_ids`, each a single prompt or a batch;
per-request fields (`sampling_params`, `rid`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `extra_key` / `cache_salt`) are one value for all or a list with one per
prompt; `token_ids_logprob` is one list of token ids for all or a list of such lists.
`sampling_params.n` (the same for every prompt) asks for n samples of each prompt: the answer
is then a list, prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]). Top-level keys this
server does not know are ignored, as SGLang ignores them; SGLang features it does not implement
(images, LoRA, ...) are refused when set. Unknown sampling parameters are refused (SGLang
rejects them too). Every error is a RequestError (HTTP 400) raised before anything runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from srt_ascend.disaggregation.protocol import BootstrapError, BootstrapInfo
from srt_ascend.managers.io_struct import MAX_TOP_LOGPROBS
from srt_ascend.managers.tokenizer_manager import RequestError

# SGLang request fields that this server accepts only when unset (null, false, empty).
UNSUPPORTED_FIELDS = (
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "return_hidden_states",
    "session_params",
    "custom_logit_processor",
    "return_routed_experts",
)
# SGLang sampling parameters without an implementation here: refused when set.
UNSUPPORTED_SAMPLING = (
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
IGNORED_SAMPLING = ("stream_interval",)  # a server-wide setting here
RENAMED_SAMPLING = {"sampling_seed": "seed"}
MAX_PARALLEL_SAMPLES = 64  # the largest `n`, as the /v1 routes cap it


@dataclass
class GenerateItem:
    """One prompt of a /generate body, ready for TokenizerManager.make_request."""

    input_ids: list[int]
    sampling_params: dict
    rid: str | None
    return_logprob: bool
    logprob_start_len: int | None
    top_logprobs_num: int | None
    extra_key: str | None
    token_ids_logprob: list[int] | None = None
    bootstrap: BootstrapInfo | None = None  # sglang-router's (prefill-decode disaggregation)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_opt_str(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(t) for t in x)


def refuse_unsupported_fields(body: dict) -> None:
    """RequestError naming the first SGLang request feature in `body` this server lacks."""
    for key in UNSUPPORTED_FIELDS:
        if body.get(key) not in (None, False, [], {}, ""):
            raise RequestError(f"{key} is not supported by this server")


def extra_key(cache_salt: str | None, key: str | None) -> str | None:
    """SGLang's radix-cache key of a request: cache_salt and extra_key concatenated."""
    return (cache_salt or "") + (key or "") or None


def clean_sampling_params(sp: Any, prefix: str = "sampling_params.") -> dict:
    """SGLang's sampling-parameter dict -> the keys SamplingParams knows; nulls dropped. The
    OpenAI routes map their fields to this dict and check it here too (prefix "")."""
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise RequestError(f"sampling_params must be an object, got {type(sp).__name__}")
    out = {}
    for key, value in sp.items():
        if value is None or key in IGNORED_SAMPLING:
            continue
        if key in UNSUPPORTED_SAMPLING:
            if value in ({}, [], "", False):
                continue
            raise RequestError(f"{prefix}{key} is not supported by this server")
        out[RENAMED_SAMPLING.get(key, key)] = value
    return out


def pop_n(sampling_params: list[dict]) -> int:
    """SGLang's parallel sample count, taken out of the sampling params (each sample is a
    request of its own, n = 1); it must be the same for every prompt and at most
    MAX_PARALLEL_SAMPLES (RequestError otherwise)."""
    ns = [sp.pop("n", 1) for sp in sampling_params]
    for n in ns:
        if not _is_int(n) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
            raise RequestError(
                f"sampling_params.n must be an integer >= 1 and at most "
                f"{MAX_PARALLEL_SAMPLES}, got {n!r}"
            )
    if len(set(ns)) > 1:
        raise RequestError("sampling_params.n must be the same for every prompt")
    return ns[0]


def parallel_samples(sampling_params: dict, n: int) -> list[dict]:
    """The sampling params of a prompt's n parallel samples, each a copy of `sampling_params`.

    Rule (vLLM's): a given seed s becomes (s + j) mod 2**64 for sample j, so the n samples
    differ, sample 0 is the request sent with n = 1, and the same (seed, n) gives the same n
    samples. /generate, the OpenAI routes and Engine.generate all derive them here. A seed
    that is not an integer is copied unchanged, for validation to refuse."""
    seed = sampling_params.get("seed")
    if not _is_int(seed):
        return [dict(sampling_params) for _ in range(n)]
    return [{**sampling_params, "seed": (seed + j) % 2**64} for j in range(n)]


@dataclass
class GenerateReqInput:
    prompts: list  # str or list[int] each
    is_single: bool  # one prompt and n == 1: the answer is one object, not a list
    sampling_params: list[dict]
    rid: list
    return_logprob: list[bool]
    logprob_start_len: list
    top_logprobs_num: list
    extra_key: list
    token_ids_logprob: list
    stream: bool
    return_text_in_logprobs: bool
    n: int = 1  # samples per prompt
    bootstrap: list[BootstrapInfo] | None = None  # one per generation (prompt-major)

    @classmethod
    def from_json(
        cls, body: Any, check_count: Callable[[int], None] | None = None
    ) -> GenerateReqInput:
        """The body checked and split per prompt; RequestError for a bad one.
        `check_count(number of prompts)`, when given, runs before the per-prompt fields are
        read (it may refuse a batch too large to be worth reading)."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        refuse_unsupported_fields(body)
        prompts, single = _prompts(body.get("text"), body.get("input_ids"))
        if check_count is not None:
            check_count(len(prompts))
        n = len(prompts)
        stream = body.get("stream", False)
        text_lp = body.get("return_text_in_logprobs", False)
        for name, value in (("stream", stream), ("return_text_in_logprobs", text_lp)):
            if not isinstance(value, bool):
                raise RequestError(f"{name} must be a boolean, got {value!r}")
        sp = _per_item(
            body, "sampling_params", n, lambda v: v is None or isinstance(v, dict), "an object"
        )
        sampling_params = [clean_sampling_params(x) for x in sp]
        samples = pop_n(sampling_params)
        return cls(
            prompts=prompts,
            is_single=single and samples == 1,
            sampling_params=sampling_params,
            rid=_per_item(body, "rid", n, _is_opt_str, "a string"),
            return_logprob=[
                bool(x)
                for x in _per_item(
                    body,
                    "return_logprob",
                    n,
                    lambda v: v is None or isinstance(v, bool),
                    "a boolean",
                )
            ],
            logprob_start_len=_per_item(
                body, "logprob_start_len", n, lambda v: v is None or _is_int(v), "an integer"
            ),
            top_logprobs_num=_per_item(
                body, "top_logprobs_num", n, lambda v: v is None or _is_int(v), "an integer"
            ),
            extra_key=[
                extra_key(salt, key)
                for salt, key in zip(
                    _per_item(body, "cache_salt", n, _is_opt_str, "a string"),
                    _per_item(body, "extra_key", n, _is_opt_str, "a string"),
                )
            ],
            token_ids_logprob=_token_ids_logprob(body.get("token_ids_logprob"), n),
            stream=stream,
            return_text_in_logprobs=text_lp,
            n=samples,
            bootstrap=bootstraps_of(body, len(prompts), samples),
        )

    async def items(self, tokenize: Callable[[str], Awaitable[list[int]]]) -> list[GenerateItem]:
        """One item per prompt and sample, prompt-major; text prompts go through `tokenize`
        (async: off the loop). With n > 1 a given rid becomes rid-0 .. rid-(n-1) and a
        given seed one per sample (`parallel_samples`)."""
        ids = [await tokenize(p) if isinstance(p, str) else p for p in self.prompts]
        samples = [parallel_samples(sp, self.n) for sp in self.sampling_params]
        return [
            GenerateItem(
                input_ids=ids[i],
                sampling_params=samples[i][j],
                rid=self.rid[i] if self.n == 1 or self.rid[i] is None else f"{self.rid[i]}-{j}",
                return_logprob=self.return_logprob[i],
                logprob_start_len=self.logprob_start_len[i],
                top_logprobs_num=self.top_logprobs_num[i],
                extra_key=self.extra_key[i],
                token_ids_logprob=self.token_ids_logprob[i],
                bootstrap=None if self.bootstrap is None else self.bootstrap[i * self.n + j],
            )
            for i in range(len(self.prompts))
            for j in range(self.n)
        ]


def bootstraps_of(body: dict, prompts: int, n: int) -> list[BootstrapInfo] | None:
    """sglang-router's bootstrap_host / bootstrap_port / bootstrap_room, one BootstrapInfo
    per generation (`prompts` x `n`, prompt-major; None when absent); RequestError when they
    are partial or malformed (BootstrapInfo.per_generation)."""
    try:
        return BootstrapInfo.per_generation(*(body.get(k) for k in BOOTSTRAP_KEYS), prompts, n)
    except BootstrapError as e:
        raise RequestError(str(e)) from None


BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _prompts(text: Any, input_ids: Any) -> tuple[list, bool]:
    """(prompts, is_single) from `text` or `input_ids`."""
    if (text is None) == (input_ids is None):
        raise RequestError("exactly one of text or input_ids must be given")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), False
        raise RequestError("text must be a string or a non-empty list of strings")
    if _is_ids(input_ids):
        return [input_ids], True
    if isinstance(input_ids, list) and all(_is_ids(x) for x in input_ids):
        return list(input_ids), False
    raise RequestError("input_ids must be a list of integers or a list of such lists")


def _token_ids_logprob(value: Any, n: int) -> list:
    """SGLang's token_ids_logprob: one list of ids for every prompt, or one (or null) each."""
    if value is None or _is_ids(value):
        return [value or None] * n
    if isinstance(value, list) and all(v is None or _is_ids(v) for v in value):
        if len(value) != n:
            raise RequestError(f"token_ids_logprob has {len(value)} entries for {n} prompts")
        return [v or None for v in value]
    raise RequestError(
        "token_ids_logprob must be a list of token ids or a list of such lists, one per prompt"
    )


def _per_item(body: dict, name: str, n: int, ok: Callable[[Any], bool], kind: str) -> list:
    """A per-request field: one value for every prompt, or a list of n values."""
    value = body.get(name)
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise RequestError(f"{name} has {len(values)} entries for {n} prompts")
    for v in values:
        if not ok(v):
            raise RequestError(f"{name} must be {kind} (or a list of them), got {v!r}")
    return values


# ---- the OpenAPI description of the native bodies ---------------------------------------------
# `GenerateReqInput.from_json` (above) is the validator, with SGLang's messages; these models
# describe the same contract in /openapi.json (a unit test keeps the two in step).


class SamplingParamsBody(BaseModel):
    """SGLang's sampling parameters as this server implements them; others are refused."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(128, ge=0)
    min_new_tokens: int | None = Field(0, ge=0)
    temperature: float | None = Field(1.0, ge=0)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = -1
    min_p: float | None = Field(0.0, ge=0, le=1)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(1.0, gt=0, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None  # token id -> added to its logit
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    n: int | None = Field(1, ge=1, le=MAX_PARALLEL_SAMPLES)  # samples per prompt: a list back
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed
    # constrained generation, at most one: a JSON schema (as a JSON string), a regular
    # expression, an EBNF grammar (xgrammar's GBNF dialect), or an xgrammar structural tag
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # MTP drafts per step for this request: 0 .. the server's --speculative-num-steps
    speculative_num_steps: int | None = Field(None, ge=0)
    stream_interval: int | None = None  # ignored: a server-wide setting here


def _one_or_list(t: Any) -> Any:
    return t | list[t] | None


class GenerateRequest(BaseModel):
    """`POST /generate` (SGLang's GenerateReqInput): exactly one of text / input_ids, a single
    prompt or a batch; per-request fields are one value or a list with one per prompt.
    Other top-level keys are ignored; SGLang features this server lacks are refused."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: _one_or_list(SamplingParamsBody) = None
    rid: _one_or_list(str) = None
    return_logprob: _one_or_list(bool) = None
    logprob_start_len: _one_or_list(int) = None
    top_logprobs_num: (
        Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
        | list[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]]
        | None
    ) = None
    extra_key: _one_or_list(str) = None
    # logprobs of these token ids at every reported position (one list, or one per prompt)
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    cache_salt: _one_or_list(str) = None  # joins extra_key: prefixes are shared within one key
    stream: bool = False
    return_text_in_logprobs: bool = False
    # sglang-router --pd-disaggregation's: the prefill server's bootstrap endpoint, the room
    # that pairs the request's prefill and decode halves
    bootstrap_host: _one_or_list(str) = None
    bootstrap_port: _one_or_list(int) = None
    bootstrap_room: _one_or_list(int) = None


class AbortRequest(BaseModel):
    """`POST /abort_request`: the rid of one request, or abort_all."""

    rid: str = ""
    abort_all: bool = False
