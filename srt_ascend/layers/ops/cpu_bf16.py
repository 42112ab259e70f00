"""A batch-invariant bf16 (and float32) linear for CPU (`cpu_bf16.cpp`), for
`--enable-deterministic-inference`.

Each output element is accumulated in float32 over K in one fixed order (K's pairs in index
order, each pair's odd product then its even one, as AVX-512 BF16's VDPBF16PS adds them), then
the bias is added and the sum rounded to bf16. The order depends on K alone, so a row's bits
never depend on how many rows share the call: one kernel serves a decode step's one row and a
prefill's thousands, with no row plan, padding or probe. Vector lanes run over output columns
(the weight packed once into 16-column blocks of K pairs, `pack`), so there is no horizontal
reduction, and threads split columns, never K. Paths: AVX-512 BF16, AVX-512F and AVX2 (bf16
widened to float32, two fused multiply-adds a pair), scalar; all give the same bits, products
of bf16 values being exact in float32 (VDPBF16PS flushes float32 denormals, the others keep
them). `reference` is the same order in torch ops. float32 operands: acc = fma(x[k], w[k],
acc) for k in order, one rounding a step on every path (not yet used by the mode: `linear`).

Built with torch's C++ extension builder the first time a process needs it (cached under
`TORCH_EXTENSIONS_DIR`). Where it cannot be built, or `SRT_ASCEND_CPU_BF16_KERNEL=0` is set,
the mode's bf16 linears stay on oneDNN's prepacked path (`onednn_packed`), with one warning
naming the reason.
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops.cpp_ops import CppOps

ENV = "SRT_ASCEND_CPU_BF16_KERNEL"
LANES = 16  # output columns per packed block
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512_bf16": 4}
_LIB = CppOps(
    "srt_ascend_cpu_bf16",
    "cpu_bf16.cpp",
    "srt_cpu_bf16",
    ENV,
    "the deterministic mode's bf16 linears run on oneDNN",
)


def enabled() -> bool:
    return _LIB.enabled()


def configure(on: bool) -> None:
    """Use the ops (built when next needed) or the torch path from now on, for this process
    (benchmarks compare both in one run; a server keeps the environment's choice)."""
    _LIB.configure(on)


def ops():
    """The ops (`torch.ops.srt_cpu_bf16`), built on first use; None where disabled or not buildable
    (said once)."""
    return _LIB.ops()


def unavailable() -> str | None:
    """Why the ops are not used (after `ops()` was called), or None."""
    return _LIB.unavailable()


def path_name() -> str:
    """The vector path the kernel takes on this CPU (needs the ops)."""
    best = ops().best_path()
    return next(name for name, v in PATHS.items() if v == best)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight bf16 [N, K] as [ceil(N/16), ceil(K/2), 16, 2], float32 as [ceil(N/16), K, 16, 1]
    (zero padded)."""
    return ops().pack(weight.detach())


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """x [M, K] (the packed weight's dtype) times its first n rows, transposed, plus bias:
    [M, n] in x's dtype."""
    return ops().linear(x, packed, n, bias, PATHS[path])


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The bf16 kernel's arithmetic in torch ops (the same float32 roundings in the same
    order)."""
    k = x.shape[-1]
    xf, wf = x.float(), weight.float()
    if k % 2:
        xf, wf = torch.nn.functional.pad(xf, (0, 1)), torch.nn.functional.pad(wf, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for p in range(xf.shape[1] // 2):
        for j in (2 * p + 1, 2 * p):  # each product exact, each add one rounding
            acc = acc + xf[:, j : j + 1] * wf[:, j]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)
