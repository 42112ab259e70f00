"""A C++ op library of this package (`layers/ops/*.cpp`) built with torch's C++ extension
builder the first time a process needs it (cached under `TORCH_EXTENSIONS_DIR` for later
processes; model load asks for it, so no step ever builds it). Where it cannot be built (no C++
compiler or ninja) or its environment switch is `0`, `ops()` is None and the callers keep
their torch path, after one warning naming the reason."""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)


class CppOps:
    """The op namespace `torch.ops.<namespace>` built from `source` (a file beside this one)
    as extension `name`; `env` = 0 switches it off; `fallback` names, in the warning, what
    runs instead."""

    def __init__(self, name: str, source: str, namespace: str, env: str, fallback: str) -> None:
        self.name, self.namespace, self.env, self.fallback = name, namespace, env, fallback
        self.source = os.path.join(os.path.dirname(os.path.abspath(__file__)), source)
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}  # "ops": the namespace, or "why": why not used

    def enabled(self) -> bool:
        return os.environ.get(self.env, "1") != "0"

    def configure(self, on: bool) -> None:
        """Use the ops (built when next needed, the environment read again) or not, from now
        on, for this process (benchmarks compare both paths in one run)."""
        with self._lock:
            self._state.clear()
            if not on:
                self._state["why"] = "configured off"

    def ops(self):
        """The op namespace, built on first use; None where disabled or not buildable."""
        state = self._state
        if "ops" in state or "why" in state:
            return state.get("ops")
        with self._lock:
            if "ops" in state or "why" in state:
                return state.get("ops")
            if not self.enabled():
                state["why"] = f"{self.env}=0"
                return None
            try:
                state["ops"] = self._build()
            except Exception as e:  # noqa: BLE001 - any build failure falls back, said once
                state["why"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                logger.warning(
                    "%s unavailable (%s); %s", os.path.basename(self.source), state["why"],
                    self.fallback,
                )  # fmt: skip
        return state.get("ops")

    def unavailable(self) -> str | None:
        """Why the ops are not used (after `ops()` was called), or None."""
        return self._state.get("why")

    def _build(self):
        from torch.utils import cpp_extension

        logger.info("loading %s (built once per machine, cached)", os.path.basename(self.source))
        cpp_extension.load(
            name=self.name,
            sources=[self.source],
            extra_cflags=["-O3"],
            is_python_module=False,
            verbose=False,
        )
        return getattr(torch.ops, self.namespace)
