"""Compiling the Triton kernels for a GPU that is not here (tests, benchmarks, CI on CPU).

`triton.compile` builds PTX and a cubin for any `GPUTarget` with the ptxas Triton ships, so the
compile rules the interpreter does not enforce (no plain module globals inside a jitted
function, types, shared memory) are checked on a CPU machine. `compiling_for(capability)`
goes further: inside it the ops' own launch functions (`mla_attention`, `store_kv`, ...)
run as on that GPU - same launch constants, same argument specialisation - given CPU tensors,
and every launch compiles its variant for the target and launches nothing. So "every variant
the server can launch compiles" is checked through the code path serving takes.

Triton internals touched (3.3): the active driver (`triton.runtime.driver.set_active`) and
each kernel's per-device cache (`JITFunction.device_caches`), swapped for the context and
restored after it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# Shared memory a block may use (bytes): sm_80 163 KiB, sm_86/89 99 KiB, sm_90 227 KiB.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class CompiledVariant:
    """One compiled kernel variant: its name, launch constants, target, and what the compiler
    reports - shared memory (bytes), registers per thread, the stack frame (bytes; ptxas
    puts spilled registers there, so 0 means no spills) - and the warps per program."""

    kernel: str
    constants: dict
    capability: int
    shared: int
    registers: int
    stack: int
    num_warps: int


class _NoDeviceUtils:
    def __init__(self, capability: int) -> None:
        self.capability = capability

    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": MAX_SHARED.get(self.capability, MAX_SHARED[86])}

    def load_binary(self, name, kernel, shared, device):
        return None, None, -1, -1  # nothing to load a cubin into


class OfflineDriver:
    """A Triton driver for CUDA capability `capability` with no device behind it: kernels
    compile for that target, launches do nothing."""

    def __init__(self, capability: int) -> None:
        self.target = GPUTarget("cuda", capability, 32)
        self.utils = _NoDeviceUtils(capability)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def jit_kernels(modules: Iterable) -> list[JITFunction]:
    """The jitted functions defined in `modules` (helpers inlined into kernels included)."""
    return [v for m in modules for v in vars(m).values() if isinstance(v, JITFunction)]


@contextmanager
def compiling_for(capability: int, kernels: Iterable[JITFunction]) -> Iterator[dict]:
    """Inside: launches of `kernels` compile for CUDA `capability` (e.g. 90, 80) and run
    nothing. Yields {kernel name: {cache key: CompiledKernel}}, filled as launches compile
    (a variant launched twice compiles once, as on a device). Compile errors raise at the
    launch, as they would on the device."""
    kernels = list(kernels)
    saved = [k.device_caches for k in kernels]
    compiled: dict[str, dict] = {}
    driver.set_active(OfflineDriver(capability))
    try:
        for k in kernels:
            k.device_caches = defaultdict(k.create_binder)
            compiled[k.__name__] = k.device_caches[0][0]
        yield compiled
    finally:
        driver.reset_active()
        for k, caches in zip(kernels, saved):
            k.device_caches = caches


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(kernel, capability: int) -> CompiledVariant:
    """What the compiler reports for one compiled kernel (`cuobjdump -res-usage` on its
    cubin: registers and stack frame; the metadata: shared memory)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = (int(found.group(1)), int(found.group(2))) if found else (-1, -1)
    names = kernel.src.fn.arg_names  # constants are keyed by argument position paths
    constants = {names[path[0]]: v for path, v in kernel.src.constants.items()}
    meta = kernel.metadata
    return CompiledVariant(
        kernel.name, constants, capability, meta.shared, regs, stack, meta.num_warps
    )


@dataclass(frozen=True)
class ModelShape:
    """What a model fixes of the kernels' launches (per attention rank)."""

    name: str
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    vocab: int
    gemm_ks: tuple[int, ...]  # reduction lengths of its GEMMs (deterministic mode)
    max_kv_len: int = 4096


# DeepSeek-V3 (128 heads, latent 512 + rope 64; GEMM reductions: hidden, q/kv latents, the
# absorbed nope/latent bmms, o_proj, dense and expert MLPs, eh_proj) and the shipped tiny
# checkpoint (srt_ascend/tools/train_tiny.py).
DEEPSEEK_V3 = ModelShape("deepseek-v3", 128, 512, 64, 129280, (
    7168, 1536, 512, 128, 16384, 18432, 2048, 14336,
))  # fmt: skip
TINY = ModelShape("tiny", 8, 64, 16, 512, (64, 32, 128, 256), max_kv_len=512)


def launch_every_variant(shape: ModelShape, dtype: torch.dtype, max_draft: int) -> int:
    """Calls every op with a Triton kernel once per launch-constant set a server for `shape`
    at `dtype` can choose (attention: every tile height, one KV part or several, default and
    batch-invariant parts; acceptance: K = 0..max_draft; the KV store, request-table writes,
    the deterministic GEMM per reduction length, with and without bias), over small CPU
    tensors laid out as serving lays them out. Inside `compiling_for` each call compiles its
    variants; under the interpreter it runs them. Returns the number of calls."""
    from srt_ascend.layers.ops import kv_cache_triton, matmul_triton, spec_accept_triton
    from srt_ascend.layers.ops import mla_attention_triton as attn

    calls = 0
    h, r, p = shape.num_heads, shape.kv_lora_rank, shape.rope_dim
    kv = torch.zeros(8, 1, r + p, dtype=dtype)  # the interleaved pool: c_kv | k_pe per slot
    r2t = torch.zeros(2, shape.max_kv_len, dtype=torch.int64)
    for fixed in (False, True):
        for q in attn.q_len_buckets(h, fixed):
            for splits in (1, 2):
                q_latent = torch.zeros(h, q, r, dtype=dtype).transpose(0, 1)  # a bmm's output
                q_pe = torch.zeros(q, h, p, dtype=dtype)
                ints = torch.tensor([0, q, q, 0], dtype=torch.int64)
                attn.mla_attention(
                    q_latent, q_pe, kv[..., :r], kv[..., r:], r2t, ints[:1], ints[1:2],
                    ints[2:3], ints[3:], 0.1, max_q_len=q, num_kv_splits=splits,
                    kv_split_size=attn.INVARIANT_KV_SPLIT if fixed else None,
                )  # fmt: skip
                calls += 1
    latent = torch.zeros(3, r + p, dtype=dtype)
    kv_cache_triton.store_kv(kv[:, 0, :r], kv[:, 0, r:], torch.zeros(3, dtype=torch.int64),
                             latent[:, :r], latent[:, r:])  # fmt: skip
    index = torch.zeros(4, dtype=torch.int64)
    kv_cache_triton.assign_req_to_token(r2t, index[:1], index[1:2], index[2:3], index[3:])
    calls += 2
    for k in range(max_draft + 1):
        drafts = torch.zeros(1, k, dtype=torch.int64)
        spec_accept_triton.greedy_accept(drafts, torch.zeros(1, k + 1, dtype=torch.int64))
        probs = torch.zeros(1, k + 1, shape.vocab)
        spec_accept_triton.rejection_sample(drafts, probs[:, :k], probs, torch.zeros(1, k + 1))
        calls += 2
    for k in shape.gemm_ks:
        for bias in (None, torch.zeros(32, dtype=dtype)):
            weight = torch.zeros(32, k, dtype=dtype)
            matmul_triton.linear(torch.zeros(2, k, dtype=dtype), weight, bias)
            calls += 1
    return calls + _launch_fp8_gemms(shape, dtype)


def _launch_fp8_gemms(shape: ModelShape, dtype: torch.dtype) -> int:
    """The block-FP8 GEMM over each reduction length of `shape`, 128 x 128 weight blocks (a
    DeepSeek FP8 checkpoint served at `dtype`): one weight block row per launch."""
    from srt_ascend.layers.ops import fp8_matmul_triton

    for k in shape.gemm_ks:
        wq = torch.zeros(128, k, dtype=torch.float8_e4m3fn)
        scale_inv = torch.ones(1, -(-k // 128))
        fp8_matmul_triton.fp8_block_linear(
            torch.zeros(2, k, dtype=dtype), wq, scale_inv, (128, 128)
        )
    return len(shape.gemm_ks)


SHAPES = {s.name: s for s in (DEEPSEEK_V3, TINY)}


def compile_cases(capability: int, cases: list[tuple[ModelShape, torch.dtype]], max_draft: int):
    """Every variant of every kernel (`launch_every_variant`) for each (shape, dtype) case,
    compiled for `capability`: the variants' resources, one per distinct compiled kernel."""
    from srt_ascend.layers.ops import (
        fp8_matmul_triton,
        kv_cache_triton,
        matmul_triton,
        spec_accept_triton,
    )
    from srt_ascend.layers.ops import mla_attention_triton as attn

    mods = (attn, kv_cache_triton, spec_accept_triton, matmul_triton, fp8_matmul_triton)
    with compiling_for(capability, jit_kernels(mods)) as compiled:
        for shape, dtype in cases:
            launch_every_variant(shape, dtype, max_draft)
    return [resources(k, capability) for cache in compiled.values() for k in cache.values()]


def main(argv: list[str] | None = None) -> int:
    """Prints one JSON line per compiled variant (kernel, target, launch constants, shared
    bytes, registers, stack bytes); exits 1 on the first kernel that fails to compile."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="CUDA capability, e.g. 80")
    parser.add_argument(
        "--case", action="append", metavar="SHAPE:DTYPE",
        help=f"model shape ({', '.join(SHAPES)}) and dtype; default deepseek-v3 at bfloat16 "
        "and float32, tiny at float32",
    )  # fmt: skip
    parser.add_argument("--max-draft", type=int, default=15, help="largest K acceptance runs")
    a = parser.parse_args(argv)
    specs = a.case or ["deepseek-v3:bfloat16", "deepseek-v3:float32", "tiny:float32"]
    cases = [(SHAPES[s], getattr(torch, d)) for s, d in (c.split(":") for c in specs)]
    for row in compile_cases(a.capability, cases, a.max_draft):
        print(json.dumps(row.__dict__, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
