"""Imports the Triton kernel modules under Triton's interpreter, for the CPU tests.

`triton.jit` reads TRITON_INTERPRET when a kernel module is imported, so the variable is set
for those imports only and restored afterwards (nothing else in the test process sees it).

The interpreter's `tl.dot` is numpy's matmul, whose BLAS (OpenBLAS's AVX2 kernels, seen on an
AMD EPYC) rounds an output row differently by the row's position inside the block: row r of
a [64, 32] @ [32, 64] product differed in its last bits from the same row at position 0 of
another. A GPU's dot computes every element of a tile alike, so the batch-invariance tests
would fail here for the BLAS, not the kernels: `exact_order_dot` replaces the interpreter's
dot with one summing each element's products in k order (`_interpreted_dot`).
"""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_MODULES = (
    "srt_ascend.layers.ops.mla_attention_triton",
    "srt_ascend.layers.ops.kv_cache_triton",
    "srt_ascend.layers.ops.spec_accept_triton",
    "srt_ascend.layers.ops.matmul_triton",
    "srt_ascend.layers.ops.fp8_matmul_triton",
)


def import_interpreted():
    """The kernel modules, interpreted (imported here first; an earlier compiled import would
    fail the assertion rather than run on CPU): returns the attention, KV, acceptance and GEMM
    modules; the block-FP8 GEMM's is imported too (import it by name afterwards)."""
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
    exact_order_dot()
    # triton.language's own helpers (tl.cdiv, ...) are interpreted only if triton itself was
    # first imported here: a test module that imports torch._dynamo (or triton) at collection,
    # before the kernel tests, makes every kernel fail with "Cannot call @triton.jit'd ..."
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(standard.cdiv, InterpretedFunction), (
        "triton was imported before the interpreter was set: import torch._dynamo/_inductor "
        "or triton inside test functions, not at a test module's top level"
    )
    return mods[:4]


def _interpreted_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's `create_dot`, each output element its products summed in k order
    (a [..., M, K] @ b [..., K, N] + d): the same bits wherever its row or column sits.
    Float8 operands (held as their uint8 bits) are converted to float16 first, exactly, as
    the interpreter's own dot does."""
    from triton.runtime.interpreter import TensorHandle

    dtype = d.data.dtype
    a_data, b_data = _fp8_as_float16(a), _fp8_as_float16(b)
    prods = a_data.astype(dtype)[..., :, :, None] * b_data.astype(dtype)[..., None, :, :]
    out = d.data.copy()
    for k in range(prods.shape[-2]):  # sequential: no pairwise or blocked summation
        out += prods[..., k, :]
    return TensorHandle(out, d.dtype.scalar)


def _fp8_as_float16(t):
    """An interpreted tensor's values as numpy: float8 bits decoded to float16 (exact for
    e4m3 and e5m2), anything else as it is."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float

    if t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating():
        return _convert_float(t.data, t.dtype, tl.float16, None).view(np.float16)
    return t.data


def exact_order_dot() -> None:
    """Installs `_interpreted_dot` as the interpreter's dot (idempotent)."""
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _interpreted_dot
