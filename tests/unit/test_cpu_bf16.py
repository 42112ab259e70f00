"""The batch-invariant CPU bf16 linear (layers/ops/cpu_bf16.cpp): every vector path gives the
bits of its torch reference (the same float32 roundings in the same order), every row of every
call size 1..130 at every position gives the bits of that row alone (threads included), odd K,
ragged N, bias, cancelling operands (whose result is the rounding error itself); and
batch-invariant mode's small bf16 linears run on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt_ascend.layers import linear as gemm
from srt_ascend.layers import row_plan
from srt_ascend.layers.ops import cpu_bf16
from srt_ascend.platforms.cpu import CpuPlatform

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    if (why := CpuPlatform().compile_unavailable()) is not None:
        pytest.skip(why)
    built = cpu_bf16.ops()
    assert built is not None, cpu_bf16.unavailable()  # a compiler is here: it must build
    return built


def paths(ops) -> list[str]:
    best = ops.best_path()
    return [name for name, v in cpu_bf16.PATHS.items() if 0 < v <= best]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("n,k,with_bias", [(37, 61, True), (64, 256, False), (20, 2, True)])
def test_paths_match_reference(ops, n, k, with_bias):
    w, x = rand(n, k, seed=1), rand(9, k, seed=2) * 4
    bias = rand(n, seed=3) if with_bias else None
    want = cpu_bf16.reference(x, w, bias)
    packed = cpu_bf16.pack(w)
    for path in paths(ops):
        assert torch.equal(bits(cpu_bf16.linear(x, packed, n, bias, path)), bits(want)), path
    close = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(want.float(), close, atol=0.05, rtol=0.02)


def test_cancelling_operands_match_reference(ops):
    """x . w == 0 exactly: the result is the float32 rounding error of this one order, which
    any other order changes far above the last bit."""
    w = row_plan.cancelling((48, 128), BF16, 1, k_dim=1, sign=-1.0)
    x = row_plan.cancelling((5, 128), BF16, 3)
    want = cpu_bf16.reference(x, w)
    assert want.abs().max() > 0  # the probe's point: a nonzero rounding error
    packed = cpu_bf16.pack(w)
    for path in paths(ops):
        assert torch.equal(bits(cpu_bf16.linear(x, packed, 48, None, path)), bits(want)), path


def test_row_invariant_every_size_and_position(ops):
    n, k, m = 72, 96, 130
    w, x, bias = rand(n, k, seed=4), rand(m, k, seed=5), rand(n, seed=6)
    packed = cpu_bf16.pack(w)
    alone = torch.cat([cpu_bf16.linear(x[i : i + 1], packed, n, bias) for i in range(m)])
    for size in range(1, m + 1):
        for start in {0, m - size, (m - size) // 2}:
            got = cpu_bf16.linear(x[start : start + size], packed, n, bias)
            assert torch.equal(bits(got), bits(alone[start : start + size])), (size, start)


def test_threads_do_not_change_bits(ops):
    w, x = rand(1024, 256, seed=7), rand(300, 256, seed=8)
    packed = cpu_bf16.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_bf16.linear(x, packed, 1024)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(bits(cpu_bf16.linear(x, packed, 1024)), bits(one))
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_clear_errors(ops):
    packed = cpu_bf16.pack(rand(32, 16))
    with pytest.raises(RuntimeError, match="K or n"):
        cpu_bf16.linear(rand(2, 18), packed, 32)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_bf16.linear(rand(2, 16).float(), packed, 32)


@pytest.fixture
def mode():
    before = (gemm.small_gemm_limit(), gemm.row_tile())
    gemm.configure(None, gemm.DETERMINISTIC_ROW_TILE)
    yield
    gemm.configure(*before)


def test_mode_runs_small_weights_on_the_kernel(ops, mode):
    w = torch.nn.Parameter(rand(208, 256, seed=9), requires_grad=False)
    x = rand(3, 5, 256, seed=10)
    got = gemm.linear(x, w)
    want = cpu_bf16.reference(x.reshape(15, 256), w).view(3, 5, 208)
    assert torch.equal(bits(got), bits(want))
    one = gemm.linear(x[1:2, 2:3], w)
    assert torch.equal(bits(one.view(-1)), bits(got[1, 2]))


@pytest.fixture(scope="module")
def moe():
    from srt_ascend.models.loader import load_model
    from srt_ascend.server_args import SHIPPED_MODEL

    model, _ = load_model(SHIPPED_MODEL, dtype=BF16, load_mtp=False)
    layer = model.model.layers[1].mlp  # 8 routed experts + the shared one
    layer.fuse_weights()
    return layer


def test_moe_takes_the_ordered_path_row_invariant(ops, mode, moe):
    """With every expert on the kernel the shipped MoE takes the ordered per-expert path (one
    token reads its own experts only): each token the same bits alone, in any batch, eager
    (sorted per-expert slices) or with static shapes (every expert over every token)."""
    x = rand(24, 256, seed=11)
    w13, w2 = moe.stacks[0].tensor, moe.stacks[1].tensor
    assert moe.experts.fixed_order(x, w13, w2)
    assert moe.experts.choose_path(1, 3, w13.shape[0], False, True) == "ordered"
    assert moe.experts.choose_path(1, 3, w13.shape[0], True, True) == "ordered_dense"
    with torch.inference_mode():
        alone = torch.cat([moe(x[i : i + 1]) for i in range(24)])
        for n in (2, 5, 24):
            assert torch.equal(bits(moe(x[:n])), bits(alone[:n])), n
            assert torch.equal(bits(moe(x[:n], static_shapes=True)), bits(alone[:n])), n
        gate = moe.gate(x)
        ids = F.pad(gate[1], (0, 1), value=moe.experts.n_experts)
        weights = F.pad(gate[0], (0, 1), value=1.0)
        dense = moe.experts.forward_dense(x, weights, ids, (w13, w2))
    torch.testing.assert_close(alone.float(), dense.float(), rtol=2e-2, atol=2e-2)


def test_kernel_off_leaves_the_mode_on_onednn(ops, mode, monkeypatch):
    """SRT_ASCEND_CPU_BF16_KERNEL=0 (or no compiler): no layer on the kernel, said once."""
    w = torch.nn.Parameter(rand(208, 256, seed=12), requires_grad=False)
    x = rand(4, 256, seed=13)
    monkeypatch.setenv(cpu_bf16.ENV, "0")
    cpu_bf16.configure(True)  # forget the built ops: the next use reads the environment
    try:
        assert not gemm.fixed_order_covers(x, w)
        assert cpu_bf16.unavailable() == f"{cpu_bf16.ENV}=0"
        got = gemm.linear(x, w)  # oneDNN's packed product under its row plan
        assert torch.equal(bits(got[2:3]), bits(gemm.linear(x[2:3], w)))
    finally:
        monkeypatch.delenv(cpu_bf16.ENV)
        cpu_bf16.configure(True)
    assert gemm.fixed_order_covers(x, w)


def test_float32_paths_agree_and_rows_are_invariant(ops):
    n, k, m = 40, 77, 130
    g = torch.Generator().manual_seed(14)
    w, x, bias = (torch.randn(*s, generator=g) for s in ((n, k), (m, k), (n,)))
    packed = cpu_bf16.pack(w)
    want = cpu_bf16.linear(x, packed, n, bias, "scalar")  # std::fma a step, k in order
    for path in paths(ops):
        assert torch.equal(
            cpu_bf16.linear(x, packed, n, bias, path).view(torch.int32), want.view(torch.int32)
        ), path
    alone = torch.cat([cpu_bf16.linear(x[i : i + 1], packed, n, bias) for i in range(m)])
    for size in (1, 2, 7, 16, 64, 129):
        got = cpu_bf16.linear(x[m - size :], packed, n, bias)
        assert torch.equal(got.view(torch.int32), alone[m - size :].view(torch.int32)), size
    torch.testing.assert_close(want, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
