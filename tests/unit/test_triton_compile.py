"""Every Triton kernel compiles for the GPU, checked on CPU: `triton.compile` builds PTX and a
cubin for sm_90 and sm_80 with the ptxas Triton ships (`layers/ops/triton_offline.py`). The
ops' own launch functions run over CPU tensors laid out as serving lays them out, once per
launch-constant set a server can choose (every attention tile height, one KV part or several,
batch-invariant parts, acceptance at K = 0..15, KV store, request table, the deterministic
GEMM), and each launch compiles its variant for the target instead of running.

The interpreter tests cannot see Triton's compile rules: a module global read inside a
jitted function (`spec_accept_triton.TINY`, which aborted every sampled MTP request on an
H200) and a `while` key loop around Hopper's wgmma dots (Triton 3.3's fence pass asserts)
both ran there and failed here. Compiles run in child processes (the kernel modules are
interpreted in this one), the two targets at once, through Triton's cache
(`TRITON_CACHE_DIR`, ~/.triton/cache): a first run takes ~20 s per target on one core, a
cached one a few seconds. DeepSeek-V3's float32 tiles (~12 s each to compile) are left to
`python -m srt_ascend.layers.ops.triton_offline` (all cases by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Nothing here imports triton or a kernel module: the other kernel tests import them under
# the interpreter, which must come first (tests/unit/triton_interpreter.py).
SHARED_MEMORY_BUDGET = 100 * 1024  # mla_attention_triton.SHARED_MEMORY_BUDGET
SM86_SHARED = 101376  # triton_offline.MAX_SHARED[86]: the least a GPU from sm_80 on gives
CASES = ["deepseek-v3:bfloat16", "tiny:float32"]
KERNELS = {
    "_mla_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel", "_assign_kernel",
    "_greedy_kernel", "_rejection_kernel", "_bmm_kernel",
}  # fmt: skip


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
    assert {r["kernel"] for r in rows} == KERNELS
    attention = [r for r in rows if r["kernel"] == "_mla_attention_kernel"]
    # Per case: (3 tile heights + the batch-invariant fixed tile) x (one KV part, split).
    # DeepSeek-V3 (128 heads): 16-head tiles of 1, 2, 4 queries; tiny (8 heads): 2, 4, 8.
    assert len(attention) == 2 * (3 + 1) * len(CASES)
    for r in attention:
        assert r["shared"] <= SHARED_MEMORY_BUDGET, r
        if cap == 90 and r["constants"]["LOW_PRECISION_DOT"]:
            assert r["stack"] == 0, r  # DeepSeek-V3's bf16 tiles spill nothing on Hopper
    for r in rows:
        assert r["shared"] <= SM86_SHARED, r
    # One variant per dtype for acceptance (K and the batch are plain arguments).
    assert sum(r["kernel"] == "_greedy_kernel" for r in rows) == 1
    assert sum(r["kernel"] == "_rejection_kernel" for r in rows) == 2  # two vocab tiles
    # The GEMM: per dtype, with and without bias, whatever the reduction length.
    assert sum(r["kernel"] == "_bmm_kernel" for r in rows) == 4
