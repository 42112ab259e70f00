"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds the rows of one
contiguous slice of the vocabulary (rank r: ids [r * V/tp, (r + 1) * V/tp)).

- Embedding: a rank looks up the ids in its slice and writes zeros for the rest; the
  all-reduce sums exactly one non-zero row per token.
- LM head: a rank computes the logits of its slice; the all-gather concatenates them in rank
  order, so every rank holds the full [T, V] logits and samples the same tokens.

With one rank both are exactly nn.Embedding / Linear (no masking, no collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.distributed import SINGLE, TPGroup
from srt_ascend.layers.linear import Linear


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(tp.shard(vocab_size, "vocab_size"), hidden_size)
        self.tp = tp
        self.vocab_start = tp.rank * self.num_embeddings

    def reset_parameters(self) -> None:
        # The loader builds the model on the meta device, where there are no values to draw,
        # and meta's normal_ runs through torch._refs, whose first call imports torch._dynamo
        # (5 s of a server's start on 2 cores); a model built on a real device (tools/
        # train_tiny.py) is initialised as nn.Embedding is.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(hidden_size, tp.shard(vocab_size, "vocab_size"), bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> logits [..., vocab_size] (the full vocabulary on every rank)."""
        return self.tp.all_gather(super().forward(x), dim=-1)
