"""Sampling parameters (per request), their batched tensor form, and logit penalties."""

from __future__ import annotations

from srt_ascend.sampling.penalties import apply_penalties, mask_stop_tokens
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo, mix_seed
from srt_ascend.sampling.sampling_params import SAMPLING_EPS, TOP_K_ALL, SamplingParams

__all__ = [
    "SAMPLING_EPS",
    "TOP_K_ALL",
    "SamplingBatchInfo",
    "SamplingParams",
    "apply_penalties",
    "mask_stop_tokens",
    "mix_seed",
]
