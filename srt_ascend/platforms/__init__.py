"""Device layer: one small interface (`Platform`), one implementation per device, chosen by
--device (`auto` picks npu, then cuda, then cpu)."""

from __future__ import annotations

from srt_ascend.platforms import cpu, cuda, npu  # noqa: F401  (register the platforms)
from srt_ascend.platforms.base import (
    PLATFORMS,
    DeviceGraph,
    DeviceUnavailable,
    EagerReplayGraph,
    Platform,
)

__all__ = [
    "PLATFORMS",
    "DeviceGraph",
    "DeviceUnavailable",
    "EagerReplayGraph",
    "Platform",
    "get_platform",
]

_HINTS = {
    "npu": "torch_npu with CANN is not installed or no Ascend NPU is visible "
    '(pip install "srt-ascend[npu]" on an Ascend machine)',
    "cuda": "no CUDA device is visible to torch",
}


def get_platform(name: str = "auto") -> Platform:
    """`auto` picks npu, then cuda, then cpu. An unavailable explicit device raises
    DeviceUnavailable with a one-line reason."""
    if name == "auto":
        for cand in ("npu", "cuda", "cpu"):
            if PLATFORMS[cand].is_available():
                return PLATFORMS[cand]()
    if name not in PLATFORMS:
        raise DeviceUnavailable(f"unknown device {name!r} (auto, cpu, cuda, npu)")
    cls = PLATFORMS[name]
    if not cls.is_available():
        raise DeviceUnavailable(f"--device {name}: {_HINTS.get(name, 'not available')}")
    return cls()
