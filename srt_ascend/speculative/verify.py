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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from srt_ascend.layers.attention.base import AttentionBackend, create_attention_backend
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.registry import Registry

VERIFY_STRATEGIES: Registry[VerifyStrategy] = Registry("verify strategy")


class VerifyStrategy(ABC):
    name: str

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
    ) -> ForwardBatch: ...


@VERIFY_STRATEGIES.register("expand")
class BatchExpansionVerify(VerifyStrategy):
    def _backend(self, runner):
        return runner.attn_backend

    def _graph_kind(self, suffix):
        k1 = self.k + 1
        return GraphKind(f"verify_expand{suffix}", ForwardMode.TARGET_VERIFY, k1, k1, self.backend)

    def build(self, tokens, rows, seq_lens, loc, bounds=None):
        k1 = loc.shape[1]
        expand = lambda lens: [length + j for length in lens for j in range(k1)]  # noqa: E731
        if isinstance(seq_lens, torch.Tensor):
            seq = (seq_lens.view(-1, 1) + torch.arange(k1, device=seq_lens.device)).view(-1)
            bounds = expand(bounds)
        else:
            seq = expand(seq_lens)
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            tokens.reshape(-1),
            [row for row in rows for _ in range(k1)],
            seq,
            [1] * (len(rows) * k1),
            loc.reshape(-1),
            self.backend,
            bounds,
        )


@VERIFY_STRATEGIES.register("fia")
class MultiQueryFiaVerify(VerifyStrategy):
    def _backend(self, runner):
        if runner.attn_backend.serves_multi_query_verify:  # e.g. triton on CUDA
            return runner.attn_backend
        import srt_ascend.layers.attention.fia_backend  # noqa: F401  (registers "fia")

        return create_attention_backend("fia")

    def _graph_kind(self, suffix):
        k1 = self.k + 1
        return GraphKind(f"verify_fia{suffix}", ForwardMode.TARGET_VERIFY, k1, 1, self.backend)

    def build(self, tokens, rows, seq_lens, loc, bounds=None):
        k1 = loc.shape[1]
        if isinstance(seq_lens, torch.Tensor):
            seq, bounds = seq_lens - 1 + k1, [length - 1 + k1 for length in bounds]
        else:
            seq = [length - 1 + k1 for length in seq_lens]
        return self.build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            tokens.reshape(-1),
            list(rows),
            seq,
            [k1] * len(rows),
            loc.reshape(-1),
            self.backend,
            bounds,
        )
