"""Every Triton kernel compiles for the GPU, checked on CPU: `triton.compile` builds PTX and a
cubin for sm_90 and sm_80 with the ptxas Triton ships (`layers/ops/triton_offline.py`). The
ops' own launch functions run over CPU tensors laid out as serving lays them out, once per
launch-constant set a server can choose (every attention tile height, one KV part or several,
batch-invariant parts, acceptance at K = 0..15, KV store, request table, the deterministic
GEMM, the block-FP8 GEMM), and each launch compiles its variant for the target instead of
running.

The interpreter tests cannot see Triton's compile rules: a module global read inside a
jitted function (`spec_accept_triton.TINY`, which aborted every sampled MTP request on an
H200) and a `while` key loop around Hopper's wgmma dots (Triton 3.3's fence pass asserts)
both ran there and failed here. Compiles run in child processes (the kernel modules are
interpreted in this one), the two targets at once, through Triton's cache
(`TRITON_CACHE_DIR`, ~/.triton/cache): a first run takes ~35 s on a loaded 2-core machine,
a cached one a few seconds. Every attention tile - DeepSeek-V3's bf16 and float32 ones
included - must compile without spills (stack 0) within its GPU's shared memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Nothing here imports triton or a kernel module: the other kernel tests import them under
# the interpreter, which must come first (tests/unit/triton_interpreter.py).
SM86_SHARED = 101376  # triton_offline.MAX_SHARED[86]: the least a GPU from sm_80 on gives
SM90_SHARED = 232448  # triton_offline.MAX_SHARED[90]
CASES = ["deepseek-v3:bfloat16", "deepseek-v3:float32", "tiny:float32"]
KERNELS = {
    "_mla_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel", "_assign_kernel",
    "_greedy_kernel", "_rejection_kernel", "_bmm_kernel", "_fp8_block_kernel",
}  # fmt: skip
FP8_QUANTIZE = "_quantize_groups_kernel"  # where Triton stores fp8: sm_89 on


@pytest.fixture(scope="module")
def compiled() -> dict[int, list[dict]]:
    """{capability: one row per compiled variant}, both targets compiled in parallel."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "srt_ascend.layers.ops.triton_offline"]
    for case in CASES:
        cmd += ["--case", case]
    procs = {
        cap: subprocess.Popen(
            [*cmd, "--capability", str(cap)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for cap in (90, 80)
    }
    rows = {}
    for cap, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"sm_{cap}: a kernel failed to compile\n{err[-4000:]}"
        rows[cap] = [json.loads(line) for line in out.splitlines()]
    return rows


def _table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        consts = ",".join(f"{k}={v}" for k, v in r["constants"].items() if k.isupper())
        lines.append(
            f"sm_{r['capability']} {r['kernel']:22s} shared {r['shared']:6d} B  regs "
            f"{r['registers']:3d}  stack {r['stack']:4d} B  warps {r['num_warps']}  {consts}"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("cap", [90, 80])
def test_every_kernel_variant_compiles(compiled, cap):
    rows = compiled[cap]
    print("\n" + _table(rows))  # shared memory, registers, stack (spills) per variant
    assert {r["kernel"] for r in rows} == (KERNELS | {FP8_QUANTIZE} if cap == 90 else KERNELS)
    attention = [r for r in rows if r["kernel"] == "_mla_attention_kernel"]
    # Per case: (one tile height + the batch-invariant fixed tile) x (one KV part, split):
    # DeepSeek-V3's 128 heads fill every tile with one token's head block; tiny's 8 heads
    # make the float32 tile 8 heads x 2 tokens whatever the query length.
    assert len(attention) == 2 * 2 * len(CASES)
    for r in attention:
        c = r["constants"]
        assert r["stack"] == 0, r  # no spills in any shipped tile, bf16 or float32
        assert c["BLOCK_R"] == 512 or c["BLOCK_H"] == 8, r  # the full latent in one pass
        hopper = cap == 90 and c["LOW_PRECISION_DOT"]
        assert c["BLOCK_Q"] * c["BLOCK_H"] == (
            64 if hopper else 32 if c["LOW_PRECISION_DOT"] else 16
        )
        assert c["NUM_STAGES"] == (3 if hopper else 2), r  # a pipelined key loop
    for r in rows:
        hopper_tile = r["kernel"] == "_mla_attention_kernel" and r["constants"]["NUM_STAGES"] == 3
        # Hopper's tile uses sm_90's shared memory; everything else fits sm_86/89's 99 KiB.
        assert r["shared"] <= (SM90_SHARED if hopper_tile else SM86_SHARED), r
    # One variant per dtype for acceptance (K and the batch are plain arguments).
    assert sum(r["kernel"] == "_greedy_kernel" for r in rows) == 1
    assert sum(r["kernel"] == "_rejection_kernel" for r in rows) == 2  # two vocab tiles
    # The GEMM: per dtype, with and without bias, whatever the reduction length.
    assert sum(r["kernel"] == "_bmm_kernel" for r in rows) == 4
    # Block FP8: one variant per activation dtype whatever the weight's shape (the scales'
    # strides unspecialised); fp8 MMA on sm_90, float16 from the bits on sm_80; no spills.
    fp8 = [r for r in rows if r["kernel"] == "_fp8_block_kernel"]
    assert len(fp8) == 2, fp8
    for r in fp8:
        assert r["stack"] == 0 and r["constants"]["FP8_DOT"] == (cap == 90), r
    assert sum(r["kernel"] == FP8_QUANTIZE for r in rows) == (2 if cap == 90 else 0)
