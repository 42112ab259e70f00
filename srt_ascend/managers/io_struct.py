"""Typed messages between the API layer (TokenizerManager) and the Scheduler."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from srt_ascend.constrained import CompiledGrammar
from srt_ascend.disaggregation.protocol import BootstrapInfo
from srt_ascend.sampling.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # top_logprobs_num cap on every route (OpenAI's limit)


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # verified and normalized
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: only output logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # ids whose logprobs are reported per position
    stream: bool = False
    extra_key: str | None = None  # cache_salt: requests share cached prefixes only within one
    # Requests with the same routing key go to the same data-parallel attention group (the
    # samples of a prompt and its shared prefill: they meet in one radix cache).
    routing_key: str | None = None
    grammar: CompiledGrammar | None = None  # sampling_params.grammar_spec, compiled
    # sglang-router's bootstrap_host / port / room (prefill-decode disaggregation)
    bootstrap: BootstrapInfo | None = None


ABORTED_BY_CLIENT = "aborted by the client"
SERVER_SHUTTING_DOWN = "the server is shutting down"


@dataclass
class AbortReq:
    rid: str | set[str]  # "" aborts everything; a set: the scheduler's merged run of aborts
    message: str = ABORTED_BY_CLIENT  # the abort finish_reason's message


@dataclass
class FlushCacheReq:
    # -> bool (False while requests run); None on the ranks that follow a tensor-parallel leader
    reply: Future | None = field(default_factory=Future)


@dataclass
class ServingStarted:
    """The server reports ready: from now on the idle scheduler may compile its queued graphs
    (a compile holds the loop for a while; before this nothing should, so the first requests
    after the ready line do not wait for one)."""


@dataclass
class GetInternalStateReq:
    reply: Future = field(default_factory=Future)  # -> dict


@dataclass
class ReqOutput:
    """Incremental output of one request after one scheduler step.

    `new_token_ids` are the tokens committed this step (several with speculative decoding).
    `finish_reason` is set on the last message of a request; `meta` carries counters.
    `stop_text` is the output text a stop string or stop_regex matched (what is trimmed;
    `finish_reason["matched"]` is the stop string or the pattern, as SGLang reports it).
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: dict | None = None
    stop_text: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    input_token_logprobs: list | None = None  # [(logprob | None, token_id)], once
    input_top_logprobs: list | None = None
    output_token_logprobs: list = field(default_factory=list)  # [(logprob, token_id)] new only
    output_top_logprobs: list = field(default_factory=list)  # [[(logprob, token_id), ...]]
    input_token_ids_logprobs: list | None = None  # [[(logprob, asked id), ...] | None], once
    output_token_ids_logprobs: list = field(default_factory=list)  # [[(logprob, asked id)]]
