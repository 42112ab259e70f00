"""This process's child processes, read from /proc (tests/engine and tests/unit both use it).

/proc/<pid>/task/<tid>/children lists the children each thread started; a thread that ends
between the listing and the read takes its file with it, and a child that exits takes its
cmdline: both are skipped, never an error (a test must not depend on how fast threads end)."""

from __future__ import annotations

import glob
import os

GRAMMAR_CHILD = b"srt_ascend.constrained.compile_child"


def _read(path: str, mode: str = "r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):  # the thread or process has just ended
        return None


def children(marker: bytes) -> list[int]:
    """Pids of this process's children (any thread's) whose command line contains `marker`."""
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        pids += [int(p) for p in (_read(path) or "").split()]
    return [pid for pid in pids if marker in (_read(f"/proc/{pid}/cmdline", "rb") or b"")]


def grammar_children() -> list[int]:
    """Pids of this process's grammar-compiler children."""
    return children(GRAMMAR_CHILD)
