"""Batch-invariant mode's prepacked oneDNN weights (layers/onednn_packed.py) and the dense MoE's
down projection as one packed linear (moe.RoutedExperts._down_concat): each row bit-identical
whatever else the call holds, a packed copy that follows in-place writes to its weight, and the
same function as the plain path (within bf16 rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt_ascend.layers import linear as gemm
from srt_ascend.layers import onednn_packed, row_plan
from srt_ascend.server_args import SHIPPED_MODEL

BF16 = torch.bfloat16
needs_onednn = pytest.mark.skipif(
    not onednn_packed.usable(), reason="this build's oneDNN serves no packed bf16 linear"
)


@pytest.fixture
def tiles(gemm_mode):
    """Batch-invariant mode on (16-row tiles, small-GEMM routing as on the CPU platform)."""
    gemm_mode(1 << 18, gemm.DETERMINISTIC_ROW_TILE)


def rand(*shape, seed=0, dtype=BF16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rows_match_alone(fn, x: torch.Tensor) -> bool:
    """Every call size 1..len(x), at the start and at the end of x, equals x's rows alone."""
    n = x.shape[0]
    alone = torch.cat([fn(x[i : i + 1]) for i in range(n)])
    return all(
        torch.equal(fn(x[start : start + size]), alone[start : start + size])
        for size in range(1, n + 1)
        for start in {0, n - size}
    )


@needs_onednn
def test_packed_linear_rows_bit_identical_and_follow_in_place_writes(tiles):
    w = rand(208, 256, seed=1)
    x = row_plan.cancelling((70, 256), BF16, 2)
    assert onednn_packed.packed_weight(w) is not None  # this layout runs packed
    assert rows_match_alone(lambda rows: gemm.linear(rows, w), x)
    y = rand(5, 256, seed=3)
    before = gemm.linear(y, w)
    torch.testing.assert_close(before, F.linear(y, w), rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        w.mul_(2)  # exact in bf16: every product and partial sum doubles
    assert torch.equal(gemm.linear(y, w), before * 2)  # repacked, not the stale copy


def test_derived_tensors_are_kept_until_a_write_and_not_for_inference_tensors():
    t = rand(4, 8, seed=4)
    built = []

    def build():
        built.append(1)
        return t.sum(0)

    first = onednn_packed.derived(t[1:], ("sum",), build)
    assert onednn_packed.derived(t[:2], ("sum",), build) is first  # held on the base
    t.add_(1)
    assert not torch.equal(onednn_packed.derived(t, ("sum",), build), first)
    assert len(built) == 2
    with torch.inference_mode():
        frozen = rand(4, 8, seed=5).clone()
    assert onednn_packed.derived(frozen, ("sum",), build) is None
    assert onednn_packed.packed_weight(frozen) is None  # stays on F.linear


@pytest.fixture(scope="module")
def moe():
    from srt_ascend.models.loader import load_model

    model, _ = load_model(SHIPPED_MODEL, dtype=BF16, load_mtp=False)
    layer = model.model.layers[1].mlp  # 8 routed experts + the shared one: the dense path
    layer.fuse_weights()
    return layer


@needs_onednn
def test_dense_moe_down_concat_is_the_same_function_and_row_invariant(moe, tiles, monkeypatch):
    monkeypatch.setattr(gemm, "FIXED_ORDER_MAX_WEIGHT", 0)  # no layer on ops/cpu_bf16: dense
    x = rand(24, 256, seed=6)
    experts = moe.experts
    with torch.inference_mode():
        alone = torch.cat([moe(x[i : i + 1]) for i in range(24)])
        for n in (2, 5, 24):
            assert torch.equal(moe(x[:n]), alone[:n]), n
        w2 = moe.stacks[1].tensor
        assert experts._down_concat(w2, x) is not None  # the shipped shape takes it
        weights, ids = moe.gate(x)
        ids = F.pad(ids, (0, 1), value=experts.n_experts)
        weights = F.pad(weights, (0, 1), value=1.0)
        stacks = (moe.stacks[0].tensor, w2)
        concat = experts.forward_dense(x, weights, ids, stacks)
        monkeypatch.setattr(experts, "_down_concat", lambda w2, x: None)  # the batched matmul
        per_expert = experts.forward_dense(x, weights, ids, stacks)
    assert torch.equal(concat, alone)
    torch.testing.assert_close(concat.float(), per_expert.float(), rtol=2e-2, atol=2e-2)
