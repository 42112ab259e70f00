"""Block-FP8 GEMM: the Triton kernel (`layers/ops/fp8_matmul_triton.py`) against the format's
formula, and its speed against bf16 `F.linear` and the dequantising path it replaces on CUDA.

    python benchmark/fp8_gemm.py            # CUDA: checks (both dot paths), then timings
    python benchmark/fp8_gemm.py --quick    # fewer shapes and rows
    TRITON_INTERPRET=1 python benchmark/fp8_gemm.py --check   # CPU: interpreter check only

Shapes are DeepSeek-V3's (N, K) of the weights it serves in FP8; rows are token counts (a
decode batch to a prefill chunk). Timings include the activation's quantisation on the device
(what `Fp8Block.linear` runs), in microseconds per call over CUDA events.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from kernels import cuda_time

# (name, N, K): q_a + kv_a (stacked), q_b, o_proj, dense gate_up, dense down, an expert's
DEEPSEEK_V3 = [
    ("qkv_a", 2112, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384),
    ("gate_up", 36864, 7168), ("down", 7168, 18432), ("expert_down", 7168, 2048),
]  # fmt: skip
QUICK = [DEEPSEEK_V3[1], DEEPSEEK_V3[2]]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)]): 128 x 128 blocks."""
    n, k = w.shape
    pn, pk = -n % 128, -k % 128
    blocks = F.pad(w.float(), (0, pk, 0, pn)).view((n + pn) // 128, 128, (k + pk) // 128, 128)
    scale = blocks.abs().amax((1, 3), keepdim=True).clamp(min=1e-12) / 448.0
    q = (blocks / scale).to(torch.float8_e4m3fn).view(n + pn, k + pk)[:n, :k]
    return q.contiguous(), scale.view(scale.shape[0], scale.shape[2])


def check(device: str) -> list[dict]:
    """The fused activation quantisation against `quantize_fp8_groups` (its bits; values on
    the interpreter, which drops -0's sign) where the target stores fp8, and both dot paths
    against `fp8_block_reference` (aligned and unaligned shapes): one row per case, with
    `err` (relative to the largest output) and `ok`."""
    from srt_ascend.layers.ops import fp8_matmul_triton as tri
    from srt_ascend.layers.ops import quant_matmul as qm

    rows = []
    if tri.fp8_dot():
        x = torch.randn(64, 384).to(device) * torch.logspace(-6, 3, 384).to(device)
        (xq, s), (rq, rs) = tri.quantize_groups(x, 128), qm.quantize_fp8_groups(x, 128)
        same = torch.equal(s, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
        same = same or (device == "cpu" and torch.equal(xq.float(), rq.float()))
        rows.append(dict(case="fused activation quantisation", err=0.0 if same else 1.0, ok=same))
    for m, k, n in ((1, 256, 384), (33, 384, 256), (5, 200, 136)):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(device)
        wq, si = quantize_weight(torch.randn(n, k, generator=g).to(device) * 0.05)
        ref = qm.fp8_block_reference(x, wq, si, (128, 128))
        xq, s = qm.quantize_fp8_groups(x, 128)
        for fp8_mma in (True, False):
            y = tri.fp8_block_matmul(xq, s, wq, si, 128, torch.float32, fp8_mma)
            err = float((y - ref).abs().max() / ref.abs().max())
            # Hopper's fp8 MMA sums a block's 128 products in its own accumulator (module
            # docstring of the kernel): looser there than float32's order-only differences
            ok = err < (2e-3 if fp8_mma and device == "cuda" else 1e-5)
            dot = "fp8 MMA" if fp8_mma else "float16 from bits"
            rows.append(dict(case=f"m={m} k={k} n={n} {dot}", err=err, ok=ok))
    return rows


def bench(shapes, rows: list[int], iters: int) -> None:
    """Per (shape, rows): bf16 F.linear, the dequantising path, the Triton fp8 GEMM (us)."""
    from srt_ascend.layers.ops import fp8_matmul_triton as tri
    from srt_ascend.layers.ops import quant_matmul as qm

    print(f"{torch.cuda.get_device_name()}; fp8 MMA: {tri.fp8_dot()}")
    print("shape        rows  bf16_us  dequant_us  fp8_us  bf16/fp8  dequant/fp8")
    for name, n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wq, si = quantize_weight(w)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_deq, t_fp8 = (
                cuda_time(lambda fn=fn, args=args, x=x: fn(x, *args), iters)
                for fn, args in (
                    (F.linear, (w,)),
                    (qm.fp8_block_linear_dequant, (wq, si, (128, 128))),
                    (tri.fp8_block_linear, (wq, si, (128, 128))),
                )
            )
            print(f"{name:12s} {m:4d} {t_bf16:8.1f} {t_deq:11.1f} {t_fp8:7.1f} "
                  f"{t_bf16 / t_fp8:9.2f} {t_deq / t_fp8:12.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness only")
    parser.add_argument("--quick", action="store_true", help="two shapes, rows 1 and 128")
    a = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = check(device)
    for r in rows:
        print(f"{r['case']}: rel err {r['err']:.1e} {'ok' if r['ok'] else 'FAIL'}")
    ok = all(r["ok"] for r in rows)
    if device == "cpu" or a.check:
        if device == "cpu":
            print("timings need a CUDA GPU (the kernel runs on CPU only under the interpreter)")
        return 0 if ok else 1
    if a.quick:
        bench(QUICK, [1, 128], iters=20)
    else:
        bench(DEEPSEEK_V3, [1, 16, 128, 1024], iters=50)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
