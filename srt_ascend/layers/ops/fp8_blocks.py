"""DeepSeek's block FP8 in torch: the activation quantisation, the format's formula
(`fp8_block_reference`), weight dequantisation and the dequantising linear every device
without an fp8 GEMM runs. `quant_matmul` dispatches (re-exporting these names); the Triton
GEMM (`fp8_matmul_triton`) falls back here and matches `quantize_fp8_groups`'s bits."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TINY = 1e-12  # scale floor: an all-zero row quantises to zeros, not NaN


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8's activations: x [M, K] -> (xq fp8 [M, K], s float32 [M, ceil(K/group)]),
    per token per `group` channels, s = max|x| / 448."""
    m, k = x.shape
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, (k + pad) // group, group)
    s = xf.abs().amax(-1, keepdim=True).clamp(min=TINY) / FP8_MAX
    xq = (xf / s).to(torch.float8_e4m3fn).view(m, k + pad)
    return (xq[:, :k] if pad else xq), s.squeeze(-1)  # (M may be 0: no -1 in the views)


def fp8_block_reference(x, wq, scale_inv, block: tuple[int, int]):
    """The block-FP8 formula: x [M, K], wq fp8 [N, K] -> float32 [M, N], block by block."""
    bn, bk = block
    n, k = wq.shape
    xq, s = quantize_fp8_groups(x, bk)
    ws = scale_inv.float().repeat_interleave(bn, 0)[:n]  # [N, K blocks]
    out = x.new_zeros(x.shape[0], n, dtype=torch.float32)
    for j in range(-(-k // bk)):
        cols = slice(j * bk, (j + 1) * bk)
        part = xq[:, cols].float() @ wq[:, cols].float().t()
        out += part * s[:, j : j + 1] * ws[:, j]
    return out


def dequantize_fp8_blocks(wq: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """wq fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]: each bn x bk
    block times its factor (a partial last block too)."""
    bn, bk = block
    n, k = wq.shape
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return wq.float() * scale


def fp8_block_linear_dequant(x, wq, scale_inv, block: tuple[int, int]):
    """Block FP8 without an fp8 GEMM: the activation quantised as the format says, both
    operands dequantised tile by tile, one matmul in float32. x [..., K] -> [..., N]."""
    bn, bk = block
    n, k = wq.shape
    flat = x.reshape(-1, k)
    xq, s = quantize_fp8_groups(flat, bk)
    if k % bk == 0 and n % bn == 0:  # blocks as broadcast views, no expanded scale tensors
        xd = (xq.float().view(-1, k // bk, bk) * s.unsqueeze(-1)).view(-1, k)
        tiles = wq.float().view(n // bn, bn, k // bk, bk) * scale_inv.float()[:, None, :, None]
        w = tiles.view(n, k)
    else:
        xd = xq.float() * s.repeat_interleave(bk, 1)[:, :k]
        w = dequantize_fp8_blocks(wq, scale_inv, block)
    return (xd @ w.t()).to(x.dtype).view(*x.shape[:-1], n)
