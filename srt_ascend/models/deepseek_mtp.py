"""DeepSeek-V3 multi-token prediction (MTP) module: the draft model of speculative decoding.

Depth i predicts token t+2 from the main model's hidden state h_t and the embedding of token
t+1: x = eh_proj([enorm(embed(tok_{t+1})); hnorm(h_t)]) -> one decoder block (layer id
num_hidden_layers + i, its KV in the same paged pool) -> shared_head.norm -> shared LM head.
The embedding and LM head are the main model's (passed in, not owned). With more draft steps
than MTP layers, the last layer is applied again, fed its own normed output and sampled token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from srt_ascend.distributed import SINGLE, TPGroup
from srt_ascend.layers.layernorm import RMSNorm
from srt_ascend.layers.linear import Linear
from srt_ascend.models.deepseek_v3 import DecoderLayer

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    """Under tensor parallelism the block is sharded as the main model's layers are; the
    norms and eh_proj are replicated."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.block = DecoderLayer(config, layer_id, tp)
        self.shared_head = SharedHead(d, eps)

    def forward(self, embeds, hidden, positions, forward_batch: ForwardBatch | None):
        """embeds, hidden [..., d] -> normed output hidden [..., d] (feeds the LM head)."""
        x = self.block(positions, self._input(embeds, hidden), forward_batch)
        return self.shared_head.norm(x)

    def write_kv(self, embeds, hidden, positions, forward_batch: ForwardBatch) -> None:
        """Only the KV `forward` writes at these positions (DecoderLayer.write_kv)."""
        self.block.write_kv(positions, self._input(embeds, hidden), forward_batch)

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class DeepseekV3ModelMTP(nn.Module):
    """All MTP layers of a checkpoint. Owns no embedding/head: they are the main model's."""

    def __init__(
        self, config, embed_tokens: nn.Embedding, lm_head: nn.Linear, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if n < 1:
            raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers < 1)")
        self.num_layers = n
        self.first_layer_id = config.num_hidden_layers
        self.layers = nn.ModuleList(
            MTPLayer(config, config.num_hidden_layers + i, tp) for i in range(n)
        )
        # Shared, not owned: keep them out of this module's parameters/state_dict.
        self._shared = (embed_tokens, lm_head)

    def layer_for_step(self, step: int) -> int:
        """Draft step k (0-based) uses MTP layer min(k, n-1): the last one repeats."""
        return min(step, self.num_layers - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch | None = None,
        step: int = 0,
    ) -> torch.Tensor:
        """input_ids = token t+1, hidden = h_t, positions = t. Returns normed hidden for t+2."""
        embeds = self._shared[0](input_ids)
        return self.layers[self.layer_for_step(step)](embeds, hidden, positions, forward_batch)

    def write_kv(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        layer: int,
    ) -> None:
        """The KV MTP layer `layer`'s forward writes at these positions (token t+1, h_t,
        positions t), without the rest of the layer: a pass whose outputs nobody reads."""
        embeds = self._shared[0](input_ids)
        self.layers[layer].write_kv(embeds, hidden, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](hidden).float()
