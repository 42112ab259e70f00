"""Block verification (Sun et al., ICLR 2025) on a synthetic draft/target pair.

The pair is a pair of context-dependent models over a 3-token vocabulary: every prefix has its
own target and draft distribution (a fixed random table indexed by the prefix). Checks:
- the expected accepted length, measured over many verify steps from one context, matches the
  paper's closed form sum_i E_{x^i ~ draft}[p_i(x^i)] (computed exactly by enumerating every
  draft block) and is >= token-wise verification's, both measured and exact;
- decoding with block verification, step after step until K + 1 tokens are out, emits the
  target's joint distribution over those tokens (chi-square over all 3^(K+1) sequences, p >
  1e-3), and the same test rejects the tempting shortcut of stopping on the weights p_i
  themselves; at 30000 trials it rejects with probability 0.9 a shift of 0.02 (K = 2) or
  0.025 (K = 3) moved between any two sequences (the worst case), less onto unlikely ones;
- one-hot targets (greedy rows) give exactly greedy acceptance; seeded rows do not depend on
  their batch neighbours.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from srt_ascend.speculative.acceptance import (
    AcceptResult,
    block_verify,
    recovered_probs,
    rejection_sample,
)

V = 3
MAX_PREFIX = 8  # K + 1 emitted tokens plus K drafts, K <= 3


class PairModel:
    """Target and draft next-token distributions for every prefix (length < MAX_PREFIX)."""

    def __init__(self, seed: int, closeness: float = 0.6) -> None:
        g = torch.Generator().manual_seed(seed)
        n = (V + 1) ** MAX_PREFIX
        target = torch.softmax(1.5 * torch.randn(n, V, generator=g), -1)
        other = torch.softmax(1.5 * torch.randn(n, V, generator=g), -1)
        self.target = target
        self.draft = closeness * target + (1 - closeness) * other

    @staticmethod
    def index(prefix: torch.Tensor) -> torch.Tensor:  # [N, L] -> [N]
        weights = (V + 1) ** torch.arange(prefix.shape[1])
        return ((prefix + 1) * weights).sum(dim=1)

    def probs(self, table: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        return table[self.index(prefix)]


def _verify_step(model, prefix, k, rule, gen):
    """One draft + verify step for every row of `prefix` [N, L]; returns the emitted tokens
    (list of [N] tensors, -1 past each row's end) and accept_len [N]."""
    n = prefix.shape[0]
    drafts, draft_probs, target_probs, ctx = [], [], [], prefix
    for _ in range(k):
        p_d = model.probs(model.draft, ctx)
        target_probs.append(model.probs(model.target, ctx))
        draft_probs.append(p_d)
        tok = torch.multinomial(p_d, 1, generator=gen)
        drafts.append(tok)
        ctx = torch.cat([ctx, tok], dim=1)
    target_probs.append(model.probs(model.target, ctx))
    uniforms = 1.0 - torch.rand(n, k + 1, generator=gen)
    res = rule(
        torch.cat(drafts, dim=1),
        torch.stack(draft_probs, dim=1),
        torch.stack(target_probs, dim=1),
        uniforms,
    )
    return res.accept_len, res.emitted


def _decode(model, k, rule, trials, seed):
    """Runs verify steps from the empty context until every row has K + 1 tokens; rows with
    the shortest output step together (a batch shares one prefix length)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.full((trials, 2 * k + 1), -1, dtype=torch.int64)
    done = torch.zeros(trials, dtype=torch.int64)  # tokens out per row
    while (done < k + 1).any():
        length = int(done[done < k + 1].min())
        rows = (done == length).nonzero().squeeze(1)
        accept_len, emitted = _verify_step(model, seqs[rows, :length], k, rule, gen)
        for j in range(k + 1):
            live = j <= accept_len
            seqs[rows[live], length + j] = emitted[live, j]
        done[rows] += accept_len + 1
    return seqs[:, : k + 1]


def _expected_accept_lengths(model, k) -> tuple[float, float]:
    """(block, token-wise) expected accepted drafts of one step from the empty context, exact,
    over every draft prefix x^i: block sum_i E[p_i(X^i)] (the paper's closed form, from
    P(tau >= i | X^i) = p_i), token-wise sum_i E[prod_{j<=i} min(1, p_t(x_j) / p_d(x_j))]."""
    block = token = 0.0
    frontier = [((), 1.0, 1.0, 1.0)]  # (x^i, draft probability, p_i, token-wise product)
    for _ in range(k):
        nxt = []
        for seq, q, p, c in frontier:
            ctx = torch.tensor([seq], dtype=torch.int64)
            pd, pt = model.probs(model.draft, ctx)[0], model.probs(model.target, ctx)[0]
            for x in range(V):
                ratio = float(pt[x] / pd[x])
                item = (seq + (x,), q * float(pd[x]), min(1.0, p * ratio), c * min(1.0, ratio))
                block += item[1] * item[2]
                token += item[1] * item[3]
                nxt.append(item)
        frontier = nxt
    return block, token


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def _target_joint(model, k) -> torch.Tensor:  # [V^(K+1)] in itertools.product order
    out = []
    for seq in itertools.product(range(V), repeat=k + 1):
        p = 1.0
        for i, x in enumerate(seq):
            p *= float(model.probs(model.target, torch.tensor([seq[:i]], dtype=torch.int64))[0, x])
        out.append(p)
    return torch.tensor(out, dtype=torch.float64)


def _sequence_counts(seqs: torch.Tensor, k: int) -> torch.Tensor:
    codes = (seqs * V ** torch.arange(k, -1, -1)).sum(dim=1)
    return torch.bincount(codes, minlength=V ** (k + 1)).double()


@pytest.mark.parametrize("k", [2, 3])
def test_expected_accept_length_matches_the_closed_form_and_beats_token_wise(k) -> None:
    model = PairModel(seed=k)
    block_exact, token_exact = _expected_accept_lengths(model, k)
    assert block_exact > token_exact + 0.02  # the pair is chosen so the gain is visible
    trials = 40000
    gen_seed = 10 + k
    prefix = torch.zeros(trials, 0, dtype=torch.int64)
    block, _ = _verify_step(model, prefix, k, block_verify, torch.Generator().manual_seed(gen_seed))
    token, _ = _verify_step(
        model, prefix, k, rejection_sample, torch.Generator().manual_seed(gen_seed)
    )
    for measured, exact in ((block, block_exact), (token, token_exact)):
        mean, sd = measured.double().mean().item(), measured.double().std().item()
        assert abs(mean - exact) < 4 * sd / math.sqrt(trials), (mean, exact)
    assert block.double().mean() > token.double().mean()


def _block_without_stop_rule(drafts, draft_probs, target_probs, uniforms):
    """Broken on purpose: tau = the largest i with U_i <= p_i (the weights used directly as
    stop probabilities, without h_i), correction from the token-wise residual."""
    batch, k = drafts.shape
    rows = torch.arange(batch)
    p, tau = torch.ones(batch), torch.zeros(batch, dtype=torch.int64)
    for i in range(k):
        ratio = target_probs[rows, i, drafts[:, i]] / draft_probs[rows, i, drafts[:, i]]
        p = torch.clamp(p * ratio, max=1.0)
        tau = torch.where(uniforms[:, i] <= p, i + 1, tau)
    p_t = target_probs[rows, tau]
    p_d = draft_probs[rows, tau.clamp(max=k - 1)] * (tau < k).view(-1, 1)
    cdf = recovered_probs(p_t, p_d).cumsum(-1)
    final = (cdf < uniforms[:, k : k + 1] * cdf[:, -1:]).sum(-1).clamp(max=V - 1)
    emitted = torch.cat([drafts, final.view(-1, 1)], dim=1)
    emitted[rows, tau] = final
    return AcceptResult(tau, emitted)


@pytest.mark.parametrize("k", [2, 3])
def test_block_decoding_emits_the_target_distribution(k) -> None:
    model = PairModel(seed=20 + k)
    trials = 30000
    joint = _target_joint(model, k)
    seqs = _decode(model, k, block_verify, trials, seed=k)
    p = _chi_square_p(_sequence_counts(seqs, k), joint * trials)
    assert p > 1e-3, f"K={k}: chi-square p = {p:.2e}"
    broken = _decode(model, k, _block_without_stop_rule, trials, seed=k)
    p = _chi_square_p(_sequence_counts(broken, k), joint * trials)
    assert p < 1e-6, f"K={k}: the broken rule passed, p = {p:.2e}"


def test_no_drafts_samples_the_target_and_seeded_rows_ignore_neighbours() -> None:
    p_t = torch.softmax(torch.randn(1, 4, 5), -1)
    p_d = torch.softmax(torch.randn(1, 3, 5), -1)
    drafts = torch.randint(0, 5, (1, 3))

    def run(neighbours: int) -> list[list[int]]:
        out = []
        for trial in range(20):
            gens = [torch.Generator().manual_seed(trial)] + [None] * neighbours
            res = block_verify(
                torch.cat([drafts, torch.randint(0, 5, (neighbours, 3))]),
                torch.cat([p_d, torch.softmax(torch.randn(neighbours, 3, 5), -1)]),
                torch.cat([p_t, torch.softmax(torch.randn(neighbours, 4, 5), -1)]),
                generators=gens,
            )
            out.append(res.emitted[0].tolist())
        return out

    assert run(0) == run(5)
    res = block_verify(
        torch.zeros(2, 0, dtype=torch.int64),
        torch.zeros(2, 0, 5),
        torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 0.0, 0.0]]]),
    )
    assert res.accept_len.tolist() == [0, 0] and res.emitted.tolist() == [[2], [1]]
