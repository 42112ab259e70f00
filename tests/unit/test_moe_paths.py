"""The routed experts' three paths (sparse: sorted per-expert slices; dense: every expert, then
the routing weights; gathered: each assignment through its own expert's gathered weights)
compute the same sum, and the dispatch picks dense for small eager batches, gathered or dense
for graph capture."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.moe import RoutedExperts


@pytest.fixture(scope="module")
def experts() -> RoutedExperts:
    torch.manual_seed(0)
    e = RoutedExperts(8, 32, 24)
    with torch.no_grad():
        e.w13.normal_(0, 0.2)
        e.w2.normal_(0, 0.2)
    return e.eval()


def routing(t: int, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, 32, generator=g), torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize(
    "path", ["forward_dense", "forward_gathered", "forward_ordered", "forward_ordered_dense"]
)
@pytest.mark.parametrize("t", [1, 2, 3, 7, 16, 40])
@torch.inference_mode()
def test_paths_equal_sparse(experts, path, t):
    x, w, ids = routing(t, seed=t)
    torch.testing.assert_close(
        getattr(experts, path)(x, w, ids), experts.forward_sparse(x, w, ids), rtol=1e-5, atol=1e-6
    )


@torch.inference_mode()
def test_dispatch(experts, monkeypatch):
    used = []
    monkeypatch.setattr(experts, "forward_dense", lambda *a: used.append("dense") or a[0])
    monkeypatch.setattr(experts, "forward_sparse", lambda *a: used.append("sparse") or a[0])
    monkeypatch.setattr(experts, "forward_gathered", lambda *a: used.append("gathered") or a[0])
    for t in (1, 2, 16, 17):  # T*k = 2, 4, 32, 34 against E/2 = 4 and 4E = 32
        experts(*routing(t))
    for t in (1, 3, 4, 17):  # T*k = 2, 6, 8, 34 against E = 8
        experts(*routing(t), static_shapes=True)
    assert used == ["sparse", "dense", "dense", "sparse", "gathered", "gathered", "dense", "dense"]


def rank_share(experts: RoutedExperts, rank: int, size: int) -> RoutedExperts:
    """Expert parallelism's share of `experts` on `rank` of `size` (whole experts)."""
    n = experts.n_experts // size
    part = RoutedExperts(n, 32, 24, first_expert=rank * n, partitioned=True)
    with torch.no_grad():
        part.w13.copy_(experts.w13[rank * n : (rank + 1) * n])
        part.w2.copy_(experts.w2[rank * n : (rank + 1) * n])
    return part.eval()


@pytest.mark.parametrize(
    "path",
    [
        "forward_dense",
        "forward_sparse",
        "forward_gathered",
        "forward_ordered",
        "forward_ordered_dense",
    ],
)
@pytest.mark.parametrize("t", [1, 3, 16])
@torch.inference_mode()
def test_expert_parallel_shares_sum_to_the_whole(experts, path, t):
    """Each rank runs its own experts over the tokens routed to them (nothing for the rest);
    the all-reduce of the shares is the full layer's output."""
    x, w, ids = routing(t, seed=t)
    shares = [getattr(rank_share(experts, r, 2), path)(x, w, ids) for r in (0, 1)]
    whole = getattr(experts, path)(x, w, ids)
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_expert_parallel_rank_without_routed_tokens_gives_zeros(experts):
    x, w, _ = routing(4)
    ids = torch.tensor([[0, 1]] * 4)  # only rank 0's experts
    assert not rank_share(experts, 1, 2).forward_sparse(x, w, ids).any()
    assert not rank_share(experts, 1, 2).forward_dense(x, w, ids).any()
    assert not rank_share(experts, 1, 2).forward_gathered(x, w, ids).any()
    assert not rank_share(experts, 1, 2).forward_ordered(x, w, ids).any()
    assert not rank_share(experts, 1, 2).forward_ordered_dense(x, w, ids).any()
