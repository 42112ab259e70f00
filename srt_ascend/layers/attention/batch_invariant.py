"""Batch-invariant MLA attention (`--enable-deterministic-inference` on CPU): every query's
result is a function of its own query and visible KV alone, bit for bit, whatever else the
forward holds (decode, either verify layout, extend with a cached prefix, a prefill chunk,
a batch of any composition, a graph bucket's padding).

Rule: the rows are padded as in torch_native, and the KV axis further to a multiple of
`KV_TILE` with keys that no query sees. Scores are one float32 matmul whose reduction is over
the head dimension only (its length is the model's, never the batch's). The softmax runs along
each query's padded key axis (PyTorch's last-dimension kernel: key j always lands in the same
vector lane and masked keys add exact zeros, so the padding changes no bit). The weighted sum
over keys, the one reduction whose length follows the batch, is cut at fixed key positions
0, KV_TILE, 2 KV_TILE, ...: one matmul of identical shape per tile, the tiles' partial sums
added in position order (a tile past a query's keys adds exact zeros). So the reduction order
of each query's output depends only on its own KV length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt_ascend.layers.attention.base import register_attention_backend
from srt_ascend.layers.attention.torch_native import (
    PaddedRows,
    TorchNativeMLABackend,
    build_padded_rows,
)

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch

KV_TILE = 64  # keys per partial sum of the weighted sum
# --attention-backend -> (its batch-invariant variant, the devices where it is one)
# (--enable-deterministic-inference): torch_native's variant reduces with torch ops whose CPU
# kernels are fixed-order, not their CUDA ones (cuBLAS).
BATCH_INVARIANT_VARIANTS = {
    "torch_native": ("torch_native_batch_invariant", ("cpu",)),
    "triton": ("triton_batch_invariant", ("cuda",)),  # triton_backend.py: fixed tile and parts
}


def batch_invariant_backend(name: str, device_type: str = "cpu") -> str:
    """The registered name of backend `name`'s batch-invariant variant on `device_type`;
    ValueError (one line naming the backend) where it has none."""
    variant, devices = BATCH_INVARIANT_VARIANTS.get(name, (None, ()))
    if variant is None or device_type not in devices:
        have = [n for n, (_, d) in BATCH_INVARIANT_VARIANTS.items() if device_type in d]
        raise ValueError(
            f"--enable-deterministic-inference: --attention-backend {name} has no "
            f"batch-invariant variant on {device_type} (available: {', '.join(have) or 'none'})"
        )
    return variant


def pad_kv_to_tiles(meta: PaddedRows, tile: int = KV_TILE) -> PaddedRows:
    """`meta` with its KV axis padded to a multiple of `tile`: new keys read the padding slot
    (0) and are blocked for every query."""
    extra = -meta.kv_slots.shape[1] % tile
    if not extra:
        return meta
    return PaddedRows(
        F.pad(meta.kv_slots, (0, extra)),
        F.pad(meta.blocked, (0, extra), value=True),
        meta.token_row,
        meta.token_col,
        meta.max_q,
    )


def tiled_weighted_sum(probs: torch.Tensor, values: torch.Tensor, tile: int) -> torch.Tensor:
    """probs [B, M, L] @ values [B, L, R] with L a multiple of `tile`, reduced tile by tile in
    key order: sum_t probs[..., tile t] @ values[:, tile t] (float32, [B, M, R])."""
    out = None
    for start in range(0, probs.shape[-1], tile):
        part = torch.bmm(probs[..., start : start + tile], values[:, start : start + tile])
        out = part if out is None else out.add_(part)
    if out is None:
        return probs.new_zeros(probs.shape[0], probs.shape[1], values.shape[-1])
    return out


@register_attention_backend("torch_native_batch_invariant")
class BatchInvariantMLABackend(TorchNativeMLABackend):
    """torch_native's contract and padding, with the weighted sum over keys reduced in fixed
    KV tiles (module docstring). Serves the multi-query verify layout itself (rows of 1+K
    causal queries), so both verify paths run through it."""

    serves_multi_query_verify = True

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = pad_kv_to_tiles(build_padded_rows(forward_batch))

    def weighted_sum(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return tiled_weighted_sum(probs, values, KV_TILE)
