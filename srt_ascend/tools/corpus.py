"""The training corpus: CPython's own standard-library `.py` sources, present on every machine.

Files are split train/held-out by a hash of their path relative to the stdlib root, so the
split is the same wherever the same Python version is installed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

HELD_OUT_MODULUS = 20  # 1 file in 20 is held out


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    path: str

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha1(self.relpath.encode()).hexdigest()
        return int(digest, 16) % HELD_OUT_MODULUS == 0

    def read(self) -> str:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            return f.read()


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str | None = None) -> list[CorpusFile]:
    """All .py files under the stdlib, third-party site-packages excluded, sorted by path."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                out.append(CorpusFile(os.path.relpath(path, root), path))
    return sorted(out, key=lambda f: f.relpath)


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    train = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    return train, held
