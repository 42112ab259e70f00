"""srt_ascend: SGLang-style serving runtime with DeepSeek-V3 MTP speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":  # lazy: importing the package must not load torch
        from srt_ascend.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
