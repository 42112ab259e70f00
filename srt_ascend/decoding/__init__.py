"""Decoders: how a running batch advances by one step (plain, or MTP speculative)."""

from srt_ascend.decoding.base import (
    DECODERS,
    CommitFn,
    Decoder,
    DecoderHandles,
    KVHandle,
    StepRequest,
    create_decoder,
)
from srt_ascend.decoding.plain import PlainDecoder

__all__ = [
    "DECODERS",
    "CommitFn",
    "Decoder",
    "DecoderHandles",
    "KVHandle",
    "PlainDecoder",
    "StepRequest",
    "create_decoder",
]
