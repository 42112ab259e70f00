"""Imports the Triton kernel modules under Triton's interpreter, for the CPU tests.

`triton.jit` reads TRITON_INTERPRET when a kernel module is imported, so the variable is set
for those imports only and restored afterwards (nothing else in the test process sees it)."""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_MODULES = (
    "srt_ascend.layers.ops.mla_attention_triton",
    "srt_ascend.layers.ops.kv_cache_triton",
    "srt_ascend.layers.ops.spec_accept_triton",
    "srt_ascend.layers.ops.matmul_triton",
)


def import_interpreted():
    """The kernel modules, interpreted (imported here first; an earlier compiled import would
    fail the assertion rather than run on CPU)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(name) for name in KERNEL_MODULES]
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    assert sys.modules[KERNEL_MODULES[0]].INTERPRETED
    # triton.language's own helpers (tl.cdiv, ...) are interpreted only if triton itself was
    # first imported here: a test module that imports torch._dynamo (or triton) at collection,
    # before the kernel tests, makes every kernel fail with "Cannot call @triton.jit'd ..."
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(standard.cdiv, InterpretedFunction), (
        "triton was imported before the interpreter was set: import torch._dynamo/_inductor "
        "or triton inside test functions, not at a test module's top level"
    )
    return mods
