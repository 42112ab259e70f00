"""The fused CPU int8 ops (layers/ops/cpu_int8.cpp): the same bits as quant_matmul's
references for every activation dtype, row count (serial and threaded loops), zero rows,
round-half-to-even ties and saturation; the dispatchers use them on CPU; without them the
torch-op path serves the same values."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.ops import cpu_int8
from srt_ascend.layers.ops import quant_matmul as qm
from srt_ascend.layers.ops.fp8_blocks import TINY
from srt_ascend.platforms.cpu import CpuPlatform

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS = [0, 1, 3, 17, 300]  # 1-4: the int8 GEMV; 300 x 256: past the serial grain (threads)


@pytest.fixture(scope="module")
def ops():
    if (why := CpuPlatform().compile_unavailable()) is not None:
        pytest.skip(why)
    built = cpu_int8.ops()
    assert built is not None, cpu_int8.unavailable()  # a compiler is here: it must build
    return built


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _data(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, :2] *= 40  # outlier channels
    if m > 2:
        x[2] = 0  # an all-zero row: scale floored at TINY, zeros out
    wq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return x.to(dtype), wq, torch.rand(n, generator=g) / 100


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_dynamic_same_bits(ops, dtype, m):
    x, wq, ws = _data(m, 256, 96, dtype)
    want = qm.w8a8_dynamic_reference(x, wq, ws).to(dtype)
    assert torch.equal(_bits(ops.w8a8_dynamic(x, wq, ws, TINY)), _bits(want))
    q, s = ops.quantize_per_token(x, TINY)
    rq, rs = qm.quantize_per_token(x)
    assert torch.equal(q, rq) and torch.equal(_bits(s), _bits(rs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_static_same_bits(ops, dtype, m):
    x, wq, deq = _data(m, 200, 40, dtype, seed=1)
    scale, offset = torch.tensor([0.07]), torch.tensor([-3.0])
    bias = torch.randint(-(2**20), 2**20, (40,), dtype=torch.int32)
    want = qm.w8a8_static_reference(x, wq, scale, offset, bias, deq).to(dtype)
    assert torch.equal(_bits(ops.w8a8_static(x, wq, scale, offset, bias, deq)), _bits(want))


def test_ties_round_half_to_even_and_saturation(ops):
    # max |x| = 127: s = 1, so x / s is x itself; .5 ties go to the even neighbour
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0]])
    q, s = ops.quantize_per_token(x, TINY)
    assert float(s) == 1.0 and q.tolist() == [[127, 2, -4, 0, 0, 2, 126, -127]]
    wq = torch.eye(8, dtype=torch.int8)
    one, zero = torch.tensor([1.0]), torch.tensor([0.0])
    xs = torch.tensor([[-1000.0, 1000.0, 7.5, 8.5, -128.5, 127.5, 0.0, -0.5]])
    y = ops.w8a8_static(xs, wq, one, zero, torch.zeros(8, dtype=torch.int32), torch.ones(8))
    assert y.tolist() == [[-128, 127, 8, 8, -128, 127, 0, 0]]


def test_dispatchers_use_the_fused_ops(ops):
    x, wq, ws = _data(3, 64, 24, torch.bfloat16)
    flat = x.view(1, 3, 64)[:, :, :]  # [..., K] input reshaped by the dispatcher
    y = qm.w8a8_dynamic_linear(flat, wq, ws)
    assert y.shape == (1, 3, 24) and y.dtype == torch.bfloat16
    assert torch.equal(y[0], ops.w8a8_dynamic(x, wq, ws, TINY))
    xt = torch.randn(64, 5).t()  # non-contiguous rows
    assert torch.equal(qm.quantize_tokens(xt)[0], qm.quantize_per_token(xt)[0])
    assert qm._DYNAMIC_KERNELS["cpu"]() is qm._fused_dynamic


def test_disabled_falls_back_to_torch_ops(monkeypatch):
    monkeypatch.setenv(cpu_int8.ENV, "0")
    cpu_int8.configure(True)  # forget the built ops: the next use reads the environment
    try:
        assert cpu_int8.ops() is None and cpu_int8.unavailable() == f"{cpu_int8.ENV}=0"
        assert qm._DYNAMIC_KERNELS["cpu"]() is qm._w8a8_dynamic_torch
        x, wq, ws = _data(4, 64, 24, torch.bfloat16)
        want = qm.w8a8_dynamic_reference(x, wq, ws).to(torch.bfloat16)
        assert torch.equal(qm.w8a8_dynamic_linear(x, wq, ws), want)
    finally:
        monkeypatch.delenv(cpu_int8.ENV)
        cpu_int8.configure(True)
    assert cpu_int8.ops() is not None


def test_bad_inputs_are_errors(ops):
    x, wq, ws = _data(2, 64, 8, torch.float32)
    with pytest.raises(RuntimeError, match="cpu_int8"):
        ops.w8a8_dynamic(x, wq.float(), ws, TINY)
    with pytest.raises(RuntimeError, match="cpu_int8"):
        ops.w8a8_dynamic(x[:, :32], wq, ws, TINY)
    with pytest.raises(RuntimeError, match="cpu_int8"):
        ops.w8a8_dynamic(x.double(), wq, ws, TINY)
