"""Greedy acceptance and rejection sampling: exact cases, and a losslessness test with power.

Losslessness: with drafts x_i ~ p_d[i], the first emitted token must be distributed as p_t[0],
and, given the first draft was accepted, the second emitted token as p_t[1]. Each check is a
chi-square goodness-of-fit test at the 0.999 level on fixed-seed trials; the same test run on a
deliberately broken sampler (p_d dropped from the acceptance ratio) must reject.
Power: at TRIALS = 20000 the first-token test rejects with probability 0.9 a shift of 0.02
moved between any two tokens (the worst case: noncentrality 4 N d^2 against the 0.999 bound at
7 degrees of freedom), less onto a token of small probability; the second-token test sees the
rows whose first draft was accepted (> 1000, asserted), 0.09 at 1000 rows.
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.sampler import processed_probs
from srt_ascend.sampling import SamplingBatchInfo, SamplingParams
from srt_ascend.speculative.acceptance import (
    ACCEPT_METHODS,
    greedy_accept,
    recovered_probs,
    rejection_sample,
)

# scipy.stats.chi2.ppf(0.999, dof) for dof = 1..8.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}
TRIALS = 20000


def test_greedy_all_none_and_middle() -> None:
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    target = torch.tensor([[4, 5, 6, 7], [9, 5, 6, 7], [4, 5, 8, 7]])
    accept_len, emitted = greedy_accept(drafts, target)
    assert accept_len.tolist() == [3, 0, 2]
    assert emitted.tolist() == [[4, 5, 6, 7], [9, -1, -1, -1], [4, 5, 8, -1]]


def test_greedy_no_drafts_emits_target_token() -> None:
    accept_len, emitted = greedy_accept(
        torch.zeros(2, 0, dtype=torch.int64), torch.tensor([[3], [1]])
    )
    assert accept_len.tolist() == [0, 0] and emitted.tolist() == [[3], [1]]


@pytest.mark.parametrize("method", list(ACCEPT_METHODS))
def test_one_hot_target_equals_greedy(method: str) -> None:
    """Greedy rows (one-hot targets) get exact greedy acceptance from every rule, whether the
    drafts came with a distribution or were greedy themselves (one-hot)."""
    torch.manual_seed(0)
    b, k, v = 64, 3, 6
    target_ids = torch.randint(0, v, (b, k + 1))
    target_probs = torch.nn.functional.one_hot(target_ids, v).float()
    draft_probs = torch.softmax(torch.randn(b, k, v), -1)
    drafts = torch.where(torch.rand(b, k) < 0.7, target_ids[:, :k], torch.randint(0, v, (b, k)))
    expected = greedy_accept(drafts, target_ids)
    for probs in (draft_probs, torch.nn.functional.one_hot(drafts, v).float()):
        result = ACCEPT_METHODS[method](drafts, probs, target_probs)
        assert torch.equal(result.accept_len, expected.accept_len)
        assert torch.equal(result.emitted, expected.emitted)


def test_rejection_exact_uniform_cases() -> None:
    p_t = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [1, K+1=2, 3]
    p_d = torch.tensor([[[0.25, 0.25, 0.5]]])  # [1, 1, 3]
    # Draft 0: ratio 0.5/0.25 >= 1, accepted for any U; u=1.0 draws the last bonus token.
    accept_len, emitted = rejection_sample(
        torch.tensor([[0]]), p_d, p_t, torch.tensor([[1.0, 1.0]])
    )
    assert accept_len.tolist() == [1] and emitted.tolist() == [[0, 2]]
    # Draft 2: p_t = 0, always rejected; residual (0.25, 0.25, 0) -> u = 0.6 picks token 1.
    accept_len, emitted = rejection_sample(
        torch.tensor([[2]]), p_d, p_t, torch.tensor([[1e-9, 0.6]])
    )
    assert accept_len.tolist() == [0] and emitted.tolist() == [[1, -1]]


def test_recovered_probs_rule_and_fallback() -> None:
    p_t = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    p_d = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]])
    out = recovered_probs(p_t, p_d)
    torch.testing.assert_close(out[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(out[1], p_t[1])


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    torch.manual_seed(1)
    k, v = 3, 7
    p_t = torch.softmax(torch.randn(1, k + 1, v), -1)
    p_d = torch.softmax(torch.randn(1, k, v), -1)
    drafts = torch.randint(0, v, (1, k))

    def run(neighbours: int) -> list[int]:
        results = []
        for trial in range(30):
            gens = [torch.Generator().manual_seed(trial)] + [None] * neighbours
            rows = neighbours + 1
            out = rejection_sample(
                torch.cat([drafts, torch.randint(0, v, (neighbours, k))]),
                torch.cat([p_d, torch.softmax(torch.randn(neighbours, k, v), -1)]),
                torch.cat([p_t, torch.softmax(torch.randn(neighbours, k + 1, v), -1)]),
                generators=gens,
            )
            assert out.emitted.shape == (rows, k + 1)
            results.append(out.emitted[0].tolist())
        return results

    alone = run(0)
    assert run(4) == alone and run(9) == alone
    assert len({tuple(r) for r in alone}) > 1


def _pair(case: str, k: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_t [K+1, V], p_d [K, V]) for one synthetic case."""
    g = torch.Generator().manual_seed(seed)
    p_t = torch.softmax(2 * torch.randn(k + 1, v, generator=g), -1)
    # Half the draft's mass follows the target, so drafts are accepted often enough to test
    # the second position too; the other half is an unrelated distribution.
    p_d = 0.5 * p_t[:k] + 0.5 * torch.softmax(2 * torch.randn(k, v, generator=g), -1)
    if case == "target_zeros":  # the draft puts mass where the target has none
        p_t[:, : v // 2] = 0.0
        p_t = p_t / p_t.sum(-1, keepdim=True)
    elif case == "draft_zeros":  # the target puts mass where the draft has none
        p_d[:, v // 2 :] = 0.0
        p_d = p_d / p_d.sum(-1, keepdim=True)
    elif case == "greedy_draft":  # one-hot draft
        p_d = torch.nn.functional.one_hot(p_d.argmax(-1), v).float()
    elif case == "filtered":  # both through the sampler's top-k/top-p/temperature
        params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9)]
        info = SamplingBatchInfo.from_params(params, v, "cpu").repeat_interleave(k + 1)
        p_t = processed_probs(torch.randn(k + 1, v, generator=g), info)
        p_d = processed_probs(torch.randn(k, v, generator=g), info.index(list(range(k))))
    return p_t, p_d


def _simulate(p_t, p_d, seed: int, drop_draft: bool = False):
    """TRIALS independent verify steps of one request; returns (accept_len, emitted)."""
    g = torch.Generator().manual_seed(seed)
    k, v = p_d.shape
    drafts = torch.stack(
        [torch.multinomial(p_d[i], TRIALS, True, generator=g) for i in range(k)], 1
    )
    draft_probs = p_d.expand(TRIALS, k, v)
    if drop_draft:  # broken on purpose: the acceptance ratio and residual ignore p_d
        draft_probs = torch.ones_like(draft_probs)
    uniforms = 1.0 - torch.rand(TRIALS, k + 1, generator=g)
    return rejection_sample(drafts, draft_probs, p_t.expand(TRIALS, k + 1, v), uniforms)


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, 0.999 bound) of a goodness-of-fit test of `tokens` against `probs`."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives zero probability"
    expected = probs.double() * tokens.numel()
    stat = (((counts - expected) ** 2)[support] / expected[support]).sum().item()
    dof = int(support.sum()) - 1  # dof 0: one possible token, checked by the assert above
    return stat, CHI2_999[dof] if dof > 0 else float("inf")


CASES = ["random", "target_zeros", "draft_zeros", "greedy_draft", "filtered"]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", CASES)
def test_rejection_sampling_is_lossless(case: str, k: int) -> None:
    v = 5 + (k + CASES.index(case)) % 4  # V in 5..8
    seed = 100 * k + CASES.index(case)
    p_t, p_d = _pair(case, k, v, seed)
    accept_len, emitted = _simulate(p_t, p_d, seed)
    assert ((accept_len >= 0) & (accept_len <= k)).all()
    assert (emitted[torch.arange(TRIALS), accept_len] >= 0).all()
    stat, bound = _chi2(emitted[:, 0], p_t[0])
    assert stat < bound, f"first token: chi2 {stat:.1f} >= {bound}"
    first_accepted = accept_len >= 1
    assert first_accepted.sum() > 1000
    stat, bound = _chi2(emitted[first_accepted, 1], p_t[1])
    assert stat < bound, f"second token: chi2 {stat:.1f} >= {bound}"


@pytest.mark.parametrize("k", [1, 3])
def test_chi_square_check_has_power(k: int) -> None:
    p_t, p_d = _pair("random", k, 6, seed=7)
    accept_len, emitted = _simulate(p_t, p_d, seed=7, drop_draft=True)
    stat, bound = _chi2(emitted[:, 0], p_t[0])
    assert stat > bound, f"broken sampler passed: chi2 {stat:.1f} <= {bound}"


def test_uniforms_for_the_tests_only_draw_the_last_token_from_generators() -> None:
    p_t = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    p_d = torch.tensor([[[0.25, 0.25, 0.5]]])
    results = set()
    for seed in range(40):
        gen = [torch.Generator().manual_seed(seed)]
        out = rejection_sample(torch.tensor([[0]]), p_d, p_t, torch.tensor([[0.9]]), gen)
        again = rejection_sample(
            torch.tensor([[0]]),
            p_d,
            p_t,
            torch.tensor([[0.9]]),
            [torch.Generator().manual_seed(seed)],
        )
        assert torch.equal(out.emitted, again.emitted) and out.accept_len.item() == 1
        results.add(int(out.emitted[0, 1]))
    assert results == {0, 1, 2}
