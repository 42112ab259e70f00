"""Device layer: one small interface, one implementation per device, chosen by --device."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod

import torch

PLATFORMS: dict[str, type[Platform]] = {}


class DeviceUnavailable(RuntimeError):
    pass


def register_platform(name: str):
    def wrap(cls):
        PLATFORMS[name] = cls
        return cls

    return wrap


class Platform(ABC):
    name: str

    @staticmethod
    @abstractmethod
    def is_available() -> bool: ...

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def synchronize(self) -> None:  # noqa: B027 - CPU work is synchronous
        pass

    def total_memory_bytes(self) -> int:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@register_platform("cpu")
class CpuPlatform(Platform):
    name = "cpu"

    @staticmethod
    def is_available() -> bool:
        return True


@register_platform("cuda")
class CudaPlatform(Platform):
    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def total_memory_bytes(self) -> int:
        return torch.cuda.get_device_properties(0).total_memory


@register_platform("npu")
class NpuPlatform(Platform):
    name = "npu"

    @staticmethod
    def is_available() -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception:  # CANN missing or broken: torch_npu raises various errors at import
            return False
        return torch.npu.is_available()

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def total_memory_bytes(self) -> int:
        return torch.npu.get_device_properties(0).total_memory


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
        hint = {
            "npu": "torch_npu with CANN is not installed or no Ascend NPU is visible "
            '(pip install "srt-ascend[npu]" on an Ascend machine)',
            "cuda": "no CUDA device is visible to torch",
        }.get(name, "not available")
        raise DeviceUnavailable(f"--device {name}: {hint}")
    return cls()
