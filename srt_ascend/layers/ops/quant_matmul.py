"""Quantized matmuls: ModelSlim's W8A8 (static) and W8A8_DYNAMIC, DeepSeek's block FP8.

The references below state each format's arithmetic; the integer parts are exact (int8
products accumulated in int32, as the NPU's and the CPU's integer units do):

- W8A8 static (per-tensor activation, per-channel weight):
    xq  = clamp(round(x / input_scale + input_offset), -128, 127)          int8 [M, K]
    y   = (xq @ wq^T + quant_bias) * deq_scale                             wq int8 [N, K]
  quant_bias (int32 [N]) folds the activation offset (and any float bias) into the integer
  sum: quant_bias = round(bias / deq_scale) - input_offset * sum_k wq[n, k];
  deq_scale = input_scale * weight_scale.
- W8A8_DYNAMIC (per-token symmetric activation, per-channel weight):
    s   = max_k |x[m, k]| / 127;   xq = clamp(round(x / s), -127, 127)
    y   = (xq @ wq^T) * (s[m] * weight_scale[n])
- block FP8 (DeepSeek-V3: weight float8_e4m3fn in bn x bk blocks, `weight_scale_inv`
  [ceil(N/bn), ceil(K/bk)] the factor each block dequantises by; activations per token per bk
  channels, s = max |x| / 448, xq = fp8(x / s)):
    y[m, n] = sum_j (xq[m, Kj] . wq[n, Kj]) * s[m, j] * weight_scale_inv[n // bn, j]
  (float32 products of fp8 values: exact; the sum over K in float32).

Dispatch by the tensors' device (`ops.pick`): on CPU each int8 linear is one fused op
(`cpu_int8.cpp`: the quantisation, the int8 GEMM through `torch._int_mm` - oneDNN's s8s8
kernels, VNNI / AMX where present - or a vectorised GEMV for 1-4 rows, and the epilogue, in
the references' exact arithmetic, so the same bits), with these torch ops as its fallback
where the extension cannot be built; on CUDA through
`torch._int_mm` (its rows padded to the kernel's minimum), on NPU through torch_npu's
`npu_quantize` / `npu_dynamic_quant` + `npu_quant_matmul` (`platforms/npu_quant_ops.py`,
imported when first used; the references' semantics). Block FP8 on CUDA runs a Triton fp8
GEMM (`fp8_matmul_triton`: fp8 MMA on sm_89 / sm_90, bf16 MMA on upcast tiles on sm_80, the
per-block scales applied to each 128-wide K block's float32 dot; the activations quantised
per token per 128 channels on the device, by one fused launch with `quantize_fp8_groups`'s
bits on sm_89+), for 128-wide K blocks whose row blocks its tile
divides (DeepSeek-V3's 128 x 128); CPU and NPU (and CUDA for other blocks) dequantise the
weight tile by tile per call (`fp8_block_linear_dequant`, the reference's value up to float
summation order). The weights stay fp8 in memory everywhere.
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops import cpu_int8, pick
from srt_ascend.layers.ops.fp8_blocks import FP8_MAX as FP8_MAX
from srt_ascend.layers.ops.fp8_blocks import TINY as _TINY
from srt_ascend.layers.ops.fp8_blocks import dequantize_fp8_blocks as dequantize_fp8_blocks
from srt_ascend.layers.ops.fp8_blocks import fp8_block_linear_dequant as fp8_block_linear_dequant
from srt_ascend.layers.ops.fp8_blocks import fp8_block_reference as fp8_block_reference
from srt_ascend.layers.ops.fp8_blocks import quantize_fp8_groups as quantize_fp8_groups

INT8_MIN, INT8_MAX = -128, 127


# ---- references (the formats' definitions) ----


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
    """W8A8 static: clamp(round(x / scale + offset)) as int8 (round half to even)."""
    q = x.float().div(scale.float()).add_(offset.float()).round_()
    return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8_DYNAMIC: x [M, K] -> (xq int8 [M, K], s float32 [M, 1]), s = max|x| / 127."""
    # |x / s| <= 127 by construction, so the formula's clamp never binds (a last-ulp
    # 127.00001 still rounds to 127). x is cast first: abs / amax over bf16 measured no
    # faster than the cast plus float32 ones (vector_norm(inf) costs several times more).
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_(min=_TINY).div_(INT8_MAX)
    return torch.div(xf, s).round_().to(torch.int8), s


def int8_matmul_reference(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] @ wq int8 [N, K]^T -> int32 [M, N], exact (int32 accumulation)."""
    return xq.to(torch.int32) @ wq.to(torch.int32).t()


def w8a8_static_reference(x, wq, input_scale, input_offset, quant_bias, deq_scale):
    """The W8A8 static formula (module docstring): x [M, K] -> float32 [M, N]."""
    acc = int8_matmul_reference(quantize_per_tensor(x, input_scale, input_offset), wq)
    return (acc + quant_bias).float() * deq_scale.float()


def w8a8_dynamic_reference(x, wq, weight_scale):
    """The W8A8_DYNAMIC formula: x [M, K], weight_scale [N] -> float32 [M, N]."""
    xq, s = quantize_per_token(x)
    return int8_matmul_reference(xq, wq) * (s * weight_scale.float())


# ---- device implementations ----


def _int8_mm_torch(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """torch._int_mm (int32 accumulation). CUDA's kernel wants more than 16 rows and K, N
    multiples of 8: rows are zero-padded (the pad rows are dropped)."""
    m = xq.shape[0]
    if xq.device.type == "cuda" and m <= 16:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - m))
    return torch._int_mm(xq, wq.t())[:m]


def _torch_table() -> dict:
    return {"cpu": lambda: _int8_mm_torch, "cuda": lambda: _int8_mm_torch}


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] @ wq int8 [N, K]^T -> int32 [M, N] on the device's integer path."""
    if xq.shape[0] == 0:
        return xq.new_zeros(0, wq.shape[0], dtype=torch.int32)
    return pick(_torch_table(), xq.device, int8_matmul_reference)(xq, wq)


# The epilogues multiply the int32 sums by float32 scales directly (int32 * float32 promotes
# to float32 in the same pass): one multiplication by the [M, N] scale product (W8A8_DYNAMIC)
# or the [N] deq_scale (W8A8), the references' arithmetic. (Measured on the loaded 2-vCPU
# AMX machine against cast + two in-place multiplies: equal within its noise.)


def _w8a8_static_torch(x, wq, input_scale, input_offset, quant_bias, deq_scale):
    acc = int8_matmul(quantize_per_tensor(x, input_scale, input_offset), wq)
    return torch.mul(acc.add_(quant_bias), deq_scale)


def _w8a8_dynamic_torch(x, wq, weight_scale):
    xq, s = quantize_per_token(x)
    return torch.mul(int8_matmul(xq, wq), s * weight_scale)


def _fused_static(x, wq, input_scale, input_offset, quant_bias, deq_scale):
    return cpu_int8.ops().w8a8_static.default(
        x, wq, input_scale, input_offset, quant_bias, deq_scale
    )


def _fused_dynamic(x, wq, weight_scale):
    return cpu_int8.ops().w8a8_dynamic.default(x, wq, weight_scale, _TINY)


def _fused_quantize(x):
    return tuple(cpu_int8.ops().quantize_per_token.default(x, _TINY))


def _on_cpu(fused, torch_ops):
    """The CPU loader: the fused op where `cpu_int8` is built, else the torch-op path."""
    return lambda: torch_ops if cpu_int8.ops() is None else fused


def prepare(device: torch.device) -> None:
    """Builds / loads the device's int8 kernels now (at model load), not in the first step."""
    if device.type == "cpu":
        cpu_int8.ops()


def _npu_kernels():
    from srt_ascend.platforms import npu_quant_ops  # torch_npu's quant ops (lazy import)

    return npu_quant_ops


# device type -> loader of the fused kernel for tensors there (else the torch path above)
_STATIC_KERNELS = {
    "npu": lambda: _npu_kernels().w8a8_static,
    "cpu": _on_cpu(_fused_static, _w8a8_static_torch),
}
_DYNAMIC_KERNELS = {
    "npu": lambda: _npu_kernels().w8a8_dynamic,
    "cpu": _on_cpu(_fused_dynamic, _w8a8_dynamic_torch),
}
_QUANTIZE_KERNELS = {"cpu": _on_cpu(_fused_quantize, quantize_per_token)}


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token`'s values on the device's fastest path (CPU: one fused op)."""
    return pick(_QUANTIZE_KERNELS, x.device, quantize_per_token)(x)


def w8a8_static_linear(x, wq, input_scale, input_offset, quant_bias, deq_scale):
    """W8A8 static: x [..., K] -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    run = pick(_STATIC_KERNELS, x.device, _w8a8_static_torch)
    y = run(flat, wq, input_scale, input_offset, quant_bias, deq_scale)
    return y.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


def w8a8_dynamic_linear(x, wq, weight_scale):
    """W8A8_DYNAMIC: x [..., K], weight_scale float32 [N] -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    y = pick(_DYNAMIC_KERNELS, x.device, _w8a8_dynamic_torch)(flat, wq, weight_scale)
    return y.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


# device type -> loader of the block-FP8 GEMM for tensors there (else the dequantising path)
_FP8_BLOCK_KERNELS = {"cuda": lambda: _fp8_triton().fp8_block_linear}


def _fp8_triton():
    from srt_ascend.layers.ops import fp8_matmul_triton  # imported only where used

    return fp8_matmul_triton


def fp8_block_linear(x, wq, scale_inv, block: tuple[int, int]):
    """Block FP8: x [..., K], wq fp8 [N, K] -> [..., N] in x's dtype, the reference's value up
    to float32 summation order. CUDA: the Triton fp8 GEMM (`fp8_matmul_triton`); elsewhere
    `fp8_block_linear_dequant`."""
    return pick(_FP8_BLOCK_KERNELS, x.device, fp8_block_linear_dequant)(x, wq, scale_inv, block)
