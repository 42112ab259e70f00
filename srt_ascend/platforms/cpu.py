"""CPU: the embedded default and the test platform. Graphs are eager replays (opt-in)."""

from __future__ import annotations

from srt_ascend.platforms.base import Platform, register_platform


@register_platform("cpu")
class CpuPlatform(Platform):
    name = "cpu"
    # Eager replay saves no launch overhead on CPU; --enable-cpu-graph runs it anyway.
    graphs_by_default = False

    @staticmethod
    def is_available() -> bool:
        return True
