"""Req and ScheduleBatch: the scheduler's view of requests and of the batch it runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from srt_ascend.constrained import Grammar
from srt_ascend.disaggregation.protocol import BootstrapInfo
from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.sampling.penalty_state import PenaltyState
from srt_ascend.sampling.sampling_params import SamplingParams


@dataclass
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token, stop string or stop_regex pattern
    length: int = 0
    message: str = ""
    stop_text: str | None = None  # the output text a stop string / regex matched (trimmed)

    def to_json(self) -> dict:
        """SGLang's meta_info.finish_reason shape."""
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        if self.kind == "abort":
            return {"type": "abort", "message": self.message}
        return {"type": "stop", "matched": self.matched}


@dataclass
class Req:
    """One generation request. KV state: positions 0..kv_len-1 have KV in the pool, their slots
    in req_to_token[req_pool_idx]; the first `prefix_len` of them belong to the radix tree
    (locked through `last_node`); slots up to position alloc_len-1 are held by the request
    (a step allocates ahead of the KV it writes)."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    extra_key: str | None = None  # the radix cache's salt (cache_salt)
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    req_pool_idx: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0
    input_logprobs_sent: bool = False
    input_token_logprobs: list = field(default_factory=list)  # [(logprob | None, token_id)]
    input_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)
    created_time: float = field(default_factory=time.monotonic)
    # owned by the decoder running the request (speculative.SpecState for MTP); reset on release
    decoder_state: Any = None
    spec_verify_ct: int = 0  # speculative verify steps the request took part in
    spec_draft_tokens: int = 0  # drafts of it verified (its k_r summed over its steps)
    spec_accepted_tokens: int = 0  # drafts of it accepted
    # per-step outputs not yet sent: the tokens (held back up to --stream-interval), their
    # logprobs
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    pending_top_logprobs: list = field(default_factory=list)
    pending_ids_logprobs: list = field(default_factory=list)
    retracted: int = 0
    grammar: Grammar | None = None  # the output's grammar state, advanced at every commit
    penalty_state: PenaltyState | None = None  # token statistics (sampling.penalty_state)
    # prefill-decode disaggregation: where its prefill server is (None: served here alone),
    # and the logprobs of its first token (what a prefill server sends the decode server)
    bootstrap: BootstrapInfo | None = None
    first_logprobs: TokenLogprobs | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """`all_ids[-1]` without building `all_ids` (a decode step reads it per request)."""
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_sent

    def max_prefix_len(self) -> int:
        """At least one token must be computed to get logits; prompt logprobs need their
        positions recomputed too."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:  # the logits at start-1 give the logprob of token start
            limit = min(limit, self.logprob_start_len - 1)
        return max(limit, 0)


@dataclass
class ScheduleBatch:
    """The requests of one forward, with per-row extend lengths for EXTEND batches."""

    reqs: list[Req]
    forward_mode: ForwardMode
    extend_lens: list[int] = field(default_factory=list)  # EXTEND: new tokens per request
    chunked: set[str] = field(default_factory=set)  # EXTEND: rids whose prefill is incomplete

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs
