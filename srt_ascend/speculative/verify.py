"""Verify strategies: how the target model scores 1 + K tokens per request in one forward.

Both produce the same target hidden states, laid out [B, K+1, D] (row j of request b is the
token at position L-1+j, whose logits predict position L+j):
- expand (SGLang's batch expansion): K+1 single-query rows per request, all sharing the
  request's req_to_token row with seq_len L, L+1, ..., L+K; only 1-query decode attention;
- fia (vllm-ascend's approach): one row of K+1 query tokens per request through the FIA
  backend (TND, sparse_mode 3), at most 16 tokens per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from srt_ascend.layers.attention.base import AttentionBackend
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode

VERIFY_STRATEGIES: dict[str, type[VerifyStrategy]] = {}


def register_verify(name: str):
    def wrap(cls):
        VERIFY_STRATEGIES[name] = cls
        return cls

    return wrap


class VerifyStrategy(ABC):
    def __init__(
        self, build_forward_batch: Callable[..., ForwardBatch], backend: AttentionBackend
    ) -> None:
        self.build_forward_batch = build_forward_batch  # (mode, ids, rows, seq, ext, loc, backend)
        self.backend = backend

    @staticmethod
    def verify_tokens(reqs: list[Req]) -> list[list[int]]:
        """[t_{L-1}, d_1, ..., d_K] per request."""
        return [[r.all_ids[-1], *r.draft_tokens] for r in reqs]

    @abstractmethod
    def build(self, reqs: list[Req], loc: torch.Tensor) -> ForwardBatch:
        """loc [B, K+1]: slots of positions L-1 .. L-1+K, already in req_to_token."""


@register_verify("expand")
class BatchExpansionVerify(VerifyStrategy):
    def build(self, reqs, loc):
        k1 = loc.shape[1]
        rows, seq = [], []
        for r in reqs:
            rows += [r.req_pool_idx] * k1
            seq += [r.seq_len + j for j in range(k1)]
        ids = [t for toks in self.verify_tokens(reqs) for t in toks]
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            ids,
            rows,
            seq,
            [1] * len(rows),
            loc.reshape(-1),
            self.backend,
        )


@register_verify("fia")
class MultiQueryFiaVerify(VerifyStrategy):
    def build(self, reqs, loc):
        k1 = loc.shape[1]
        ids = [t for toks in self.verify_tokens(reqs) for t in toks]
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            ids,
            [r.req_pool_idx for r in reqs],
            [r.seq_len - 1 + k1 for r in reqs],
            [k1] * len(reqs),
            loc.reshape(-1),
            self.backend,
        )
