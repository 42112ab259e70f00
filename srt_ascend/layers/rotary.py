"""Rotary position embedding for DeepSeek-V3 MLA: plain RoPE or YaRN, with interleaved pairs.

DeepSeek lays the rotary dims out as interleaved pairs (x0, x1), (x2, x3), ...; each pair is
rotated by one frequency and the result is written de-interleaved ([evens' ; odds']). q and k get
the same permutation, so the dot product is the rotation's, and the cached `k_pe` is stored in the
rotated (de-interleaved) layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, params: dict[str, Any], max_pos: int):
    factor = params.get("factor")
    orig_max = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig_max
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig_max / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 - ramp  # weight of the unscaled frequency per pair
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(qk_head_dim: int, rope_params: dict[str, Any]) -> float:
    """1/sqrt(d), times mscale_all_dim's mscale squared under YaRN (DeepSeek-V3's rule)."""
    scale = qk_head_dim**-0.5
    if rope_params.get("rope_type", "default") != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(rope_params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin cache indexed by absolute position; `forward` rotates q_pe and k_pe in place-free."""

    def __init__(
        self, dim: int, max_position: int, rope_params: dict[str, Any], interleave: bool = True
    ) -> None:
        super().__init__()
        self.interleave = interleave
        self.dim = dim
        self.max_position = max_position
        if torch.get_default_device().type == "meta":  # the loader fills the caches
            # on the CPU (loader._reset_rotary); meta arithmetic would only cost time (its
            # first op through torch._refs imports torch._dynamo: seconds of a start)
            shape = (max_position, dim // 2)
            self.register_buffer("cos_cache", torch.empty(shape), persistent=False)
            self.register_buffer("sin_cache", torch.empty(shape), persistent=False)
            return
        base = float(rope_params.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type == "yarn":
            inv_freq, attn_factor = _yarn_inv_freq(dim, base, rope_params, max_position)
        elif rope_type == "default":
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attn_factor = 1.0
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, yarn)")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, dim/2]
        self.register_buffer("cos_cache", freqs.cos() * attn_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attn_factor, persistent=False)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [*P]; q_pe [*P, H, dim]; k_pe [*P, dim]. Returns rotated (q_pe, k_pe)."""
        cos, sin, rot = self._at(positions, q_pe.dtype)
        return rot(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2)), rot(k_pe, cos, sin)

    def rotate_k(self, positions: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """`forward`'s rotated k_pe alone (the same ops, the same bits)."""
        cos, sin, rot = self._at(positions, k_pe.dtype)
        return rot(k_pe, cos, sin)

    def _at(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [*P, dim/2] at these positions, and the rotation of this layout."""
        cos = self.cos_cache[positions].to(dtype)
        sin = self.sin_cache[positions].to(dtype)
        return cos, sin, _rotate_interleaved if self.interleave else _rotate_half


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... rotated; output de-interleaved (DeepSeek's layout)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x_i, x_{i + d/2}) rotated (rope_interleave = false)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
