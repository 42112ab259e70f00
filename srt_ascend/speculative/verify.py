"""Verify strategies: how the target model scores 1 + K tokens per request in one forward.

`--speculative-verify` is read once, where the MTP decoder picks its strategy; the strategy
owns the attention backend its batches run through and the graph kind that captures them.
Both produce the same target hidden states, laid out [B, K+1, D] (row j of request b is the
token at position L-1+j, whose logits predict position L+j):
- expand (SGLang's batch expansion): K+1 single-query rows per request, all sharing the
  request's req_to_token row with seq_len L, L+1, ..., L+K; only 1-query decode attention,
  through the runner's attention backend;
- fia (vllm-ascend's approach): one row of K+1 query tokens per request through the FIA
  backend (TND, sparse_mode 3), at most 16 tokens per request; where the runner's backend
  runs multi-query rows itself (triton on CUDA), through it, so the layout is captured too.

Ragged verify (expand): a step whose requests draft k_r <= K each (`Ragged`) builds only the
sum(1 + k_r) rows of positions L-1 .. L-1+k_r, not B(1+K): the rows past a request's k_r are
never built (the acceptance rule stops row r at k_r, so they would decide nothing). Their
outputs come back laid out [B, K+1] by `Ragged.expand` (row j > k_r repeats row k_r), and a
captured verify_expand graph holds them by rows (`GraphRunner._bucket`: the smallest bucket
whose B(1+K) rows hold them). FIA takes each request's 1 + k_r query tokens natively (host
lengths only: an overlapped round's FIA verify keeps 1 + K tokens per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import torch

from srt_ascend.layers.attention.base import AttentionBackend, create_attention_backend
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode, pack_to_device
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.registry import Registry

VERIFY_STRATEGIES: Registry[VerifyStrategy] = Registry("verify strategy")


class Ragged(NamedTuple):
    """The rows of a ragged verify over requests drafting `limits` (k_r each, K = the most):
    `keep` [R] indexes the kept rows in the [B, K+1] layout (row-major), `expand` [B*(K+1)]
    indexes, for every slot of that layout, the kept row it reads (row min(j, k_r) of its
    request), `first` [B] each request's first kept row; all on the device."""

    limits: list[int]
    keep: torch.Tensor
    expand: torch.Tensor
    first: torch.Tensor

    @property
    def rows(self) -> int:
        return self.keep.numel()

    @classmethod
    def of(cls, limits: Sequence[int], k: int, device) -> Ragged:
        k1 = k + 1
        keep = [b * k1 + j for b, n in enumerate(limits) for j in range(n + 1)]
        first, at = [], 0
        for n in limits:
            first.append(at)
            at += n + 1
        expand = [f + min(j, n) for f, n in zip(first, limits) for j in range(k1)]
        return cls(list(limits), *pack_to_device([keep, expand, first], device))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The kept rows of `t` [B*(K+1), ...]: [R, ...]."""
        return t.index_select(0, self.keep)

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [R, ...] of the kept layout back in the [B*(K+1), ...] one."""
        return t.index_select(0, self.expand)


class VerifyStrategy(ABC):
    name: str
    ragged = False  # builds only each request's 1 + k_r rows (`Ragged`), from host lengths
    ragged_on_device = False  # ... and from lengths on the device (an overlapped round's)

    def __init__(self, runner: ModelRunner, k: int, suffix: str = "") -> None:
        """Verifies K = `k` drafts per request (0: the target's next token only); `suffix`
        tells apart the graph kinds of several K in one server."""
        self.build_forward_batch = runner.build_forward_batch
        self.k = k
        self.backend = self._backend(runner)
        self.kind = self._graph_kind(suffix)

    @abstractmethod
    def _backend(self, runner: ModelRunner) -> AttentionBackend: ...

    @abstractmethod
    def _graph_kind(self, suffix: str) -> GraphKind: ...

    @abstractmethod
    def build(
        self,
        tokens: torch.Tensor,  # [B, K+1]: t_{L-1}, d_1..d_K per request, on the device
        rows: Sequence[int],  # [B] req_to_token rows
        seq_lens: Sequence[int] | torch.Tensor,  # [B] L: committed length per request
        loc: torch.Tensor,  # [B, K+1] slots of positions L-1 .. L-1+K, in req_to_token
        bounds: Sequence[int] | None = None,  # host upper bounds of L when it is on the device
        ragged: Ragged | None = None,  # only these rows (a strategy with `ragged`)
    ) -> ForwardBatch: ...


@VERIFY_STRATEGIES.register("expand")
class BatchExpansionVerify(VerifyStrategy):
    ragged = ragged_on_device = True

    def _backend(self, runner):
        return runner.attn_backend

    def _graph_kind(self, suffix):
        k1 = self.k + 1
        return GraphKind(f"verify_expand{suffix}", ForwardMode.TARGET_VERIFY, k1, k1, self.backend)

    def build(self, tokens, rows, seq_lens, loc, bounds=None, ragged=None):
        k1 = loc.shape[1]
        per = [k1] * len(rows) if ragged is None else [n + 1 for n in ragged.limits]
        expand = lambda lens: [x + j for x, n in zip(lens, per) for j in range(n)]  # noqa: E731
        tokens, loc = tokens.reshape(-1), loc.reshape(-1)
        if ragged is not None:
            tokens, loc = ragged.take(tokens), ragged.take(loc)
        if isinstance(seq_lens, torch.Tensor):
            seq = (seq_lens.view(-1, 1) + torch.arange(k1, device=seq_lens.device)).view(-1)
            seq = seq if ragged is None else ragged.take(seq)
            bounds = expand(bounds)
        else:
            seq = expand(seq_lens)
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            tokens,
            [row for row, n in zip(rows, per) for _ in range(n)],
            seq,
            [1] * len(seq),
            loc,
            self.backend,
            bounds,
        )


@VERIFY_STRATEGIES.register("fia")
class MultiQueryFiaVerify(VerifyStrategy):
    ragged = True  # 1 + k_r query tokens per request: FIA takes per-request query lengths

    def _backend(self, runner):
        if runner.attn_backend.serves_multi_query_verify:  # e.g. triton on CUDA
            return runner.attn_backend
        import srt_ascend.layers.attention.fia_backend  # noqa: F401  (registers "fia")

        return create_attention_backend("fia")

    def _graph_kind(self, suffix):
        k1 = self.k + 1
        return GraphKind(f"verify_fia{suffix}", ForwardMode.TARGET_VERIFY, k1, 1, self.backend)

    def build(self, tokens, rows, seq_lens, loc, bounds=None, ragged=None):
        k1 = loc.shape[1]
        tokens, loc, per = tokens.reshape(-1), loc.reshape(-1), [k1] * len(rows)
        if ragged is not None:  # host lengths only: a device batch has one query length
            if isinstance(seq_lens, torch.Tensor):
                raise ValueError("a ragged FIA verify needs host sequence lengths")
            tokens, loc = ragged.take(tokens), ragged.take(loc)
            per = [n + 1 for n in ragged.limits]
        if isinstance(seq_lens, torch.Tensor):
            seq, bounds = seq_lens - 1 + k1, [length - 1 + k1 for length in bounds]
        else:
            seq = [length - 1 + n for length, n in zip(seq_lens, per)]
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY, tokens, list(rows), seq, per, loc, self.backend, bounds
        )
