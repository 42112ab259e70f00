"""Quantized matmuls (layers/ops/quant_matmul.py): the device paths against the formats'
formulas (integer parts exact), and against the float product within quantisation error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srt_ascend.layers.ops import quant_matmul as qm
from srt_ascend.models.quant_config import QuantConfig
from srt_ascend.tools.quantize import quantize_block_fp8, quantize_per_channel, static_input_params

SHAPES = [(1, 256, 96), (5, 64, 40), (17, 768, 256), (33, 200, 24)]  # (M, K, N)


def _data(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :3] *= 8  # outlier channels
    return x, torch.randn(n, k, generator=g) / k**0.5


def _int_dot(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """int8 a [M, K] . b [N, K]^T in int64 numpy: the integer part, independently."""
    return a.numpy().astype(np.int64) @ b.numpy().astype(np.int64).T


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_matmul_exact(shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    want = _int_dot(a, b)
    assert np.array_equal(qm.int8_matmul(a, b).numpy(), want)
    assert np.array_equal(qm.int8_matmul_reference(a, b).numpy(), want)


@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_dynamic(shape):
    m, k, n = shape
    x, w = _data(m, k, n)
    wq, scale, _ = quantize_per_channel(w, torch.float32)
    y = qm.w8a8_dynamic_linear(x, wq, scale.view(-1))
    # formula, integer part exact: xq = round(x / (max|x| / 127))
    s = x.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x / s).clamp(-127, 127).to(torch.int8)
    want = torch.from_numpy(_int_dot(xq, wq)).float() * s * scale.view(-1)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qm.w8a8_dynamic_reference(x, wq, scale.view(-1)), want)
    # within int8 error of the float product: each operand off by half a step per element
    ref = x @ w.t()
    bound = 0.5 * (s * w.abs().sum(-1) / 1 + x.abs().sum(-1, keepdim=True) * scale.view(-1))
    assert bool(((y - ref).abs() <= bound * 1.01 + 1e-5).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_static(shape):
    m, k, n = shape
    x, w = _data(m, k, n, seed=2)
    wq, scale, _ = quantize_per_channel(w, torch.float32)
    in_scale, in_offset = static_input_params(float(x.min()), float(x.max()), torch.float32)
    offset = in_offset.float()
    quant_bias = (-int(in_offset) * wq.to(torch.int32).sum(-1)).to(torch.int32)
    deq = in_scale * scale.view(-1)
    y = qm.w8a8_static_linear(x, wq, in_scale, offset, quant_bias, deq)
    xq = torch.round(x / in_scale + offset).clamp(-128, 127).to(torch.int8)
    acc = torch.from_numpy(_int_dot(xq, wq) + quant_bias.numpy().astype(np.int64))
    want = acc.float() * deq
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    ref = x @ w.t()
    step = float(in_scale)
    bound = 0.5 * (step * w.abs().sum(-1) + x.abs().sum(-1, keepdim=True) * scale.view(-1))
    assert bool(((y - ref).abs() <= bound * 1.01 + 1e-5).all())


def test_static_activation_saturates():
    scale, offset = torch.tensor([0.1]), torch.tensor([5.0])
    x = torch.tensor([[-100.0, 100.0, 0.0, 0.25, 0.35]])
    q = qm.quantize_per_tensor(x, scale, offset)
    assert q.tolist() == [[-128, 127, 5, 8, 8]]  # 7.5 and 8.5 round half to even


@pytest.mark.parametrize("shape", [(3, 256, 384), (1, 200, 136), (9, 128, 128)])
def test_fp8_block(shape):
    m, k, n = shape
    x, w = _data(m, k, n, seed=3)
    wq, scale_inv = quantize_block_fp8(w)
    assert scale_inv.shape == (-(-n // 128), -(-k // 128)) and wq.dtype == torch.float8_e4m3fn
    y = qm.fp8_block_linear(x, wq, scale_inv, (128, 128))
    ref = qm.fp8_block_reference(x, wq, scale_inv, (128, 128))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # e4m3: each operand within 1/16 relative of its value (normal range)
    exact = x @ w.t()
    assert float((y - exact).abs().max()) <= 0.13 * float((x.abs() @ w.abs().t()).max())


def test_modelslim_int64_deq_scale_reads_float32_bits():
    values = torch.tensor([0.5, 1.25e-3, 3.0])
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    got = QuantConfig("modelslim").from_disk("model.layers.0.mlp.down_proj.deq_scale", bits)
    assert torch.equal(got, values)
