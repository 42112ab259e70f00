"""Attention backends over the paged MLA latent cache, registered by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from srt_ascend.registry import Registry

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
register_attention_backend = ATTENTION_BACKENDS.register


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(**kwargs)


class AttentionBackend(ABC):
    """Computes absorbed MLA attention for one layer of a ForwardBatch.

    Every mode is the same shape of problem: row b has q_len_b new query tokens at positions
    seq_len_b - q_len_b .. seq_len_b - 1 and attends, causally, over KV positions
    0 .. seq_len_b - 1 whose slots are req_to_token[req_pool_indices[b], :seq_len_b]. The new
    tokens' latents are written to `out_cache_loc` before attention, so rows that share a request
    row (batch-expanded verify) read what the shorter rows wrote in the same pass.
    """

    # Whether the backend handles ForwardBatch.static_shapes (fixed KV window, nothing read back
    # to the host), which graph capture needs.
    supports_static_shapes: bool = False
    # Whether it hands host-side lists to its op (refreshed at each graph replay).
    uses_host_lengths: bool = False
    # Whether, under static shapes, its work grows with the static KV window rather than with
    # the rows' live KV lengths (it gathers the whole window): the graph runner then captures
    # per KV-window bucket too. An op that reads the lengths on the device, or takes them from
    # the host per replay, walks only the live KV: one capture per batch bucket serves all.
    reads_whole_kv_window: bool = False
    # Whether it runs the multi-query verify layout (1+K causal query tokens per row) itself,
    # capturable: then that layout needs no FIA op on this device.
    serves_multi_query_verify: bool = False

    def warm_up_lengths(self, num_heads: int, max_kv_len: int) -> list[tuple[int, int]]:
        """(query length, KV length) of one single-row extend per compiled kernel variant
        this backend can launch (`ModelRunner.warm_up_kernels` runs them before the server
        says ready). None for backends that compile nothing."""
        return []

    def takes_length_bounds(self, device: torch.device) -> bool:
        """Whether it runs batches whose host lengths are upper bounds only (ForwardBatch
        `host_lengths_exact` False; an overlapped MTP round), reading each row's length on
        the device and the bounds only to size its KV window."""
        return True

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Precompute per-batch index tensors once, before the layers run (optional)."""

    @abstractmethod
    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, kv_lora_rank]: q_nope absorbed through W_UK
        q_pe: torch.Tensor,  # [T, H, rope_dim], rotated
        c_kv: torch.Tensor,  # [T, kv_lora_rank], new tokens' normalised latent
        k_pe: torch.Tensor,  # [T, rope_dim], new tokens' rotated rope key
        layer_id: int,
        scale: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]: attention output in latent space
        ...
