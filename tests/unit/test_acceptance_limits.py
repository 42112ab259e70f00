"""Per-request draft limits k_r: a row limited to k_r in a K-draft step gets exactly what a
K = k_r step over its first k_r drafts and uniforms U_1..U_{k_r+1} gives (greedy, token-wise,
block), whatever its neighbours' limits; the Triton kernels (interpreter) equal the torch rule."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.speculative import acceptance
from tests.unit.test_ops_kv_and_accept import random_chain
from tests.unit.triton_interpreter import import_interpreted

_, _, accept_triton, _ = import_interpreted()

K = 3


def _alone(rule, drafts, p_d, p_t, uniforms, row: int, k_r: int) -> acceptance.AcceptResult:
    """Row `row` as a K = k_r step: its first k_r drafts, k_r + 1 target rows and uniforms."""
    one = slice(row, row + 1)
    return rule(
        drafts[one, :k_r],
        p_d[one, :k_r],
        p_t[one, : k_r + 1],
        uniforms=uniforms[one, : k_r + 1],
    )


def _check_rows(res, alone_of, limits: list[int]) -> None:
    for row, k_r in enumerate(limits):
        alone = alone_of(row, k_r)
        assert res.accept_len[row] == alone.accept_len[0] <= k_r
        assert torch.equal(res.emitted[row, : k_r + 1], alone.emitted[0])
        assert (res.emitted[row, k_r + 1 :] == -1).all()


@pytest.mark.parametrize("rule", ["token", "block"])
def test_sampled_limits_equal_a_shorter_step(rule):
    fn = acceptance.ACCEPT_METHODS[rule]
    gen = torch.Generator().manual_seed(7)
    seen = set()
    for trial in range(6):
        drafts, p_d, p_t, u = random_chain(gen, 8, K, 48, torch.float32)
        limits = [(row + trial) % (K + 1) for row in range(8)]
        res = fn(drafts, p_d, p_t, uniforms=u, limits=torch.tensor(limits))
        chain = (drafts, p_d, p_t, u)
        _check_rows(res, lambda r, k, c=chain: _alone(fn, *c, r, k), limits)
        seen |= {(k, int(a)) for k, a in zip(limits, res.accept_len)}
    assert {(k, k) for k in range(1, K + 1)} & seen and (K, 0) in seen  # both outcomes ran


def test_greedy_limits_and_triton():
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, 3, (12, K), generator=gen)
    target = torch.randint(0, 3, (12, K + 1), generator=gen)
    target[:6, :K] = drafts[:6]  # these accept every draft they may
    limits = torch.tensor([row % (K + 1) for row in range(12)])
    res = acceptance.greedy_accept(drafts, target, limits)
    for row, k_r in enumerate(limits.tolist()):
        alone = acceptance.greedy_accept(
            drafts[row : row + 1, :k_r], target[row : row + 1, : k_r + 1]
        )
        assert res.accept_len[row] == alone.accept_len[0]
        assert torch.equal(res.emitted[row, : k_r + 1], alone.emitted[0])
    assert res.accept_len[:6].tolist() == limits[:6].tolist()
    triton_len, triton_emitted = accept_triton.greedy_accept(drafts, target, limits)
    assert torch.equal(triton_len, res.accept_len) and torch.equal(triton_emitted, res.emitted)


def test_token_limits_triton_equals_torch():
    gen = torch.Generator().manual_seed(11)
    for batch, vocab in ((9, 64), (5, 1500)):
        chain = random_chain(gen, batch, K, vocab, torch.float32)
        limits = torch.randint(0, K + 1, (batch,), generator=gen)
        limits[0] = 0
        accept_len, emitted = accept_triton.rejection_sample(*chain, limits)
        rule = acceptance.rejection_sample(*chain[:3], uniforms=chain[3], limits=limits)
        assert torch.equal(accept_len, rule.accept_len) and torch.equal(emitted, rule.emitted)
        assert (accept_len <= limits).all()


def test_generators_give_a_shorter_steps_uniforms():
    """Drawn from generators, a row's U_1..U_{k_r+1} of a K-step are those a K = k_r step
    draws (a prefix of the same stream), so seeded rows are independent of the batch's K."""
    gen = torch.Generator().manual_seed(5)
    drafts, p_d, p_t, _ = random_chain(gen, 4, K, 32, torch.float32)
    limits = [0, 1, 2, 3]
    gens = lambda: [torch.Generator().manual_seed(100 + r) for r in range(4)]  # noqa: E731
    res = acceptance.rejection_sample(
        drafts, p_d, p_t, generators=gens(), limits=torch.tensor(limits)
    )
    for row, (k_r, g) in enumerate(zip(limits, gens())):
        one = slice(row, row + 1)
        alone = acceptance.rejection_sample(
            drafts[one, :k_r], p_d[one, :k_r], p_t[one, : k_r + 1], generators=[g]
        )
        assert torch.equal(res.emitted[row, : k_r + 1], alone.emitted[0])
