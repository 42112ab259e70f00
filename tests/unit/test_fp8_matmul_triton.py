"""The block-FP8 Triton GEMM (`layers/ops/fp8_matmul_triton.py`) under Triton's interpreter.

What the interpreter covers (Triton 3.3.1): float8e4nv loads (fp8 tensors are held as their
uint8 bits) and `tl.dot` on fp8 tiles, which it computes from exact float16 copies of the
e4m3 values with float32 sums (tests/unit/triton_interpreter.py keeps that in its k-order
dot): the kernel's fp8-MMA path (sm_89 / sm_90), masks, per-block scales and the K loop run
here against the format's formula (`quant_matmul.fp8_block_reference`). The sm_80 path (tiles
upcast to bf16 before the dot) is compile-checked only (test_triton_compile.py): the
interpreter's bf16 dot is wrong in this Triton. The CUDA dispatch is checked under
FakeTensorMode with fake cuda tensors (the launch recorded, not run).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from srt_ascend.layers.ops import quant_matmul as qm
from srt_ascend.layers.quantization import QUANT_METHODS
from tests.unit.test_quant_ops import quantize_block_fp8
from tests.unit.triton_interpreter import import_interpreted

import_interpreted()
from srt_ascend.layers.ops import fp8_matmul_triton as fp8_triton  # noqa: E402 (interpreted)

BLOCK = (128, 128)


def _problem(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :7] *= 40.0  # one outlier group: per-group scales differ by far
    w = torch.randn(n, k, generator=g) * 0.05
    wq, scale_inv = quantize_block_fp8(w)
    return x, wq, scale_inv


@pytest.mark.parametrize("fp8_mma", [True, False], ids=["fp8-mma", "fp16-from-bits"])
@pytest.mark.parametrize(
    "m,k,n", [(1, 256, 384), (5, 128, 128), (33, 384, 256), (5, 200, 136), (33, 72, 200)]
)
def test_matches_the_formula(m, k, n, fp8_mma):
    """Both dot paths (sm_89+'s fp8 MMA; sm_80's float16 MMA on decoded bits) give the
    formula's value up to float32 summation order; N, K unaligned in the last two cases."""
    assert fp8_triton.INTERPRETED
    x, wq, scale_inv = _problem(m, k, n, seed=m + k + n)
    xq, s = qm.quantize_fp8_groups(x, BLOCK[1])
    y = fp8_triton.fp8_block_matmul(xq, s, wq, scale_inv, BLOCK[0], torch.float32, fp8_mma)
    ref = qm.fp8_block_reference(x, wq, scale_inv, BLOCK)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # products exact; only float32 summation order differs: within 4 ulps of the sum of the
    # terms' magnitudes (measured: under 1)
    bound = qm.fp8_block_reference(x.abs(), wq.float().abs().to(wq.dtype), scale_inv, BLOCK)
    assert bool(((y - ref).abs() <= 4 * 2**-23 * bound + 1e-30).all())


def test_fp8_bits_decode_exactly():
    """Every finite e4m3 value through both dot paths (the sm_80 path's bit decoding): a
    GEMM against the identity (scales 1) returns each value exactly, subnormals and signs
    included."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], codes[:2]])  # no NaN; 256 codes
    values = codes.view(torch.float8_e4m3fn).view(2, 128)
    eye = torch.eye(128).to(torch.float8_e4m3fn)
    ones = torch.ones(2, 1)
    for fp8_mma in (True, False):
        y = fp8_triton.fp8_block_matmul(values, ones, eye, ones[:1], 128, torch.float32, fp8_mma)
        assert torch.equal(y, values.float()), fp8_mma


def _near_every_code() -> torch.Tensor:
    """Groups whose scale is 1 (a 448 first) holding every e4m3 value, the midpoints between
    neighbours (ties: to even) and the floats either side of each midpoint."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    near = torch.cat([grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    near = torch.nn.functional.pad(near, (0, -near.numel() % 127)).view(-1, 127)
    return torch.cat([torch.full((near.shape[0], 1), 448.0), near], 1)


@pytest.mark.parametrize("case", ["random-float32", "random-bfloat16", "every-code"])
def test_fused_quantisation_is_the_reference(case):
    """`quantize_groups` (one launch) gives `quantize_fp8_groups`'s scales bit for bit and
    its fp8 values: random groups spanning 9 decades (K unaligned), and the values around
    every e4m3 code. (Values, not bits: the interpreter's cast drops a negative zero's sign,
    a GPU's keeps it.)"""
    if case == "every-code":
        x = _near_every_code()
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(33, 200, generator=g) * torch.logspace(-6, 3, 200)
        x = x.to(getattr(torch, case.split("-")[1]))
    xq, s = fp8_triton.quantize_groups(x, 128)
    ref_q, ref_s = qm.quantize_fp8_groups(x, 128)
    assert torch.equal(s, ref_s) and torch.equal(xq.float(), ref_q.float())
    assert case != "every-code" or bool((s == 1).all())


def test_output_in_the_activation_dtype_and_rows_independent():
    x, wq, scale_inv = _problem(33, 256, 256, seed=7)
    y = fp8_triton.fp8_block_linear(x.to(torch.bfloat16).view(3, 11, 256), wq, scale_inv, BLOCK)
    assert y.shape == (3, 11, 256) and y.dtype == torch.bfloat16
    one = fp8_triton.fp8_block_linear(x[20:21].to(torch.bfloat16), wq, scale_inv, BLOCK)
    assert torch.equal(one[0], y.view(33, 256)[20])  # a row's value does not depend on M


def test_refused_blocks_take_the_dequantising_path():
    x, wq, scale_inv = _problem(4, 256, 128, seed=3)
    wq64 = wq[:64]  # 64-row blocks: the 128-wide tile would straddle two scale rows
    assert not fp8_triton.supports((64, 128)) and fp8_triton.supports(BLOCK)
    y = fp8_triton.fp8_block_linear(x, wq64, scale_inv, (64, 128))
    assert torch.equal(y, qm.fp8_block_linear_dequant(x, wq64, scale_inv, (64, 128)))


def test_empty_batch():
    _, wq, scale_inv = _problem(1, 128, 128, seed=1)
    y = fp8_triton.fp8_block_linear(torch.zeros(0, 128), wq, scale_inv, BLOCK)
    assert y.shape == (0, 128)


def test_cuda_dispatch_reaches_the_kernel(monkeypatch):
    """Fp8Block.linear on (fake) cuda tensors: the activation quantised on the device, then
    the Triton GEMM's launch with fp8 operands, float32 scales and the activation's dtype."""
    launches = []

    def record(xq, x_scale, wq, scale_inv, group_n, out_dtype, fp8_mma=None):
        launches.append((xq.device.type, xq.dtype, x_scale.dtype, wq.dtype, group_n, out_dtype))
        return torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)

    def quantize(x, group):
        launches.append(("quantize", x.device.type, x.dtype, group))
        return qm.quantize_fp8_groups(x, group)  # torch ops: shapes only under the fake mode

    monkeypatch.setattr(fp8_triton, "fp8_block_matmul", record)
    monkeypatch.setattr(fp8_triton, "quantize_groups", quantize)
    method = QUANT_METHODS["FP8_BLOCK"]()
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = torch.device("cuda")
        t = {"weight": torch.empty(256, 384, dtype=torch.float8_e4m3fn, device=cuda),
             "weight_scale_inv": torch.empty(2, 3, device=cuda)}  # fmt: skip
        y = method.linear(torch.empty(2, 5, 384, dtype=torch.bfloat16, device=cuda), t)
        assert y.shape == (2, 5, 256) and y.device.type == "cuda"
    fp8 = torch.float8_e4m3fn
    assert launches == [
        ("quantize", "cuda", torch.bfloat16, 128),
        ("cuda", fp8, torch.float32, fp8, 128, torch.bfloat16),
    ]
