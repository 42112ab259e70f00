"""Per-request lengths under --speculative-adaptive (`AdaptiveDraftLength.lengths`), on the
synthetic costs of test_draft_length: a batch mixing requests that accept every draft with
requests that accept none runs the latter apart as the plain step when that pays by the
margin, drafts for every request when they all accept alike, and sets none apart on every
EXPLORE_EVERY-th plan; the fixed policy always gives K."""

from __future__ import annotations

import pytest
from test_draft_length import BUCKETS

from srt_ascend.speculative.draft_length import (
    EXPLORE_EVERY,
    PLAIN_SAMPLES,
    AdaptiveDraftLength,
    Estimate,
    FixedDraftLength,
    capped,
)
from srt_ascend.speculative.step_costs import CostTable

HIGH, LOW = [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]


def costed() -> AdaptiveDraftLength:
    """A policy over a hand-made cost table: up to 8 requests every step costs 1 (memory
    bound); at 16, K drafts cost 1 + K (the verify's tokens now count)."""
    policy = AdaptiveDraftLength(3, BUCKETS)
    table = {(b, k): 1.0 for b in BUCKETS for k in range(4)}
    table.update({(16, k): 1.0 + k for k in range(4)})
    policy.costs = CostTable(BUCKETS, 3, table)
    return policy


def test_low_acceptance_requests_run_apart():
    policy = costed()
    # 16 requests, half accepting everything, half nothing: the best single K is 0 (16 tokens
    # for 1; K = 3 gives 40 for 4), a plain step over the LOW half and K = 3 over the HIGH
    # one give 40 for 1 + 1 (1.25x: past the margin). At 8 requests K = 3 for all wins.
    estimates = [HIGH, LOW] * 8
    k = policy.choose(estimates)
    lengths = policy.lengths(estimates, k, count=True)
    assert [lengths[r] for r in range(1, 16, 2)] == [0] * 8  # the LOW ones run apart
    assert [lengths[r] for r in range(0, 16, 2)] == [3] * 8  # the HIGH ones draft
    small = [HIGH, LOW] * 4
    assert policy.lengths(small, policy.choose(small), count=True) == [3] * 8


def test_alike_requests_draft_together_and_exploration_sets_none_apart():
    policy = costed()
    same = [HIGH] * 8
    k = policy.choose(same)
    assert k == 3 and policy.lengths(same, k, count=True) == [3] * 8
    mixed = [HIGH, LOW] * 8
    k = policy.peek(mixed)
    seen = [policy.plan(mixed, count=True, per_request=True) for _ in range(EXPLORE_EVERY)]
    assert seen.count([3] * 16) == 1  # the explored plan: everyone drafts, nobody apart
    assert sum(0 in plan for plan in seen) == EXPLORE_EVERY - 1
    assert policy.lengths(mixed, k, count=False) == policy.lengths(mixed, k, count=False)


def test_fixed_policy_gives_every_request_k():
    policy = FixedDraftLength(2, BUCKETS)
    assert policy.lengths([HIGH, LOW, LOW], 2, count=True) == [2, 2, 2]


def ragged_costed(per_row: float) -> AdaptiveDraftLength:
    """A ragged-verify policy: every step costs 1 + its rows x `per_row` (K = 0: the plain
    step over B rows); the row profile is exactly that row term."""
    policy = AdaptiveDraftLength(3, BUCKETS)
    policy.ragged = True
    table = {(b, k): 1.0 + b * (k + 1) * per_row for b in BUCKETS for k in range(4)}
    rows = {n: n * per_row for n in (1, 2, 4, 8, 16, 32, 64)}
    policy.costs = CostTable(BUCKETS, 3, table, rows)
    return policy


def test_ragged_cost_follows_the_rows():
    policy = ragged_costed(0.1)
    costs = policy.costs
    priced = costs.ragged_costs(4, 3, 4)  # 4 requests: 4 .. 16 rows
    assert len(priced) == 13 and abs(priced[-1] - costs.cost(4, 3)) < 1e-9
    assert abs(costs.cost(4, 3) - 2.6) < 1e-9
    assert abs(priced[0] - (1.0 + 0.4)) < 1e-9  # 4 rows: a plain step's
    costs.observe(4, 3, 2 * 1.4, rows=4)  # served twice as slow as profiled, 4 rows
    assert abs(costs.cost(4, 3) - 2 * 2.6) < 1e-9  # the scale of its (bucket, K)


def test_a_ragged_step_is_never_priced_below_the_plain_step():
    """The step profile and the row profile are timed apart. Where a full step's rows
    profile at more than the whole step (192 rows at 51 ms, the K = 2 step at 42.5 ms: bf16
    on 2 CPU cores without AMX), drafts for a few requests cost the plain step plus their
    rows, not less than the plain step (they were priced below it, and ran)."""
    policy = AdaptiveDraftLength(2, [16])
    policy.ragged = True
    profile = {(16, 0): 10.0, (16, 1): 20.0, (16, 2): 18.0}
    rows = {1: 2.0, 16: 8.0, 32: 14.0, 48: 30.0}  # 48 rows: more than the whole K = 2 step
    policy.costs = costs = CostTable([16], 2, profile, rows)
    priced = costs.ragged_costs(16, 2, 16, 2)
    assert priced == pytest.approx([10.0, 10.375, 10.75])  # the plain step, then its rows
    assert costs.priced(16, 2, 18) == pytest.approx(10.75)
    assert costs.priced(16, 0) == 10.0
    # the whole step's fixed part where it is the larger: K = 1 over 32 rows costs 20
    assert costs.ragged_costs(16, 1, 16)[-1] == pytest.approx(20.0)
    # drafts accepted half the time: no plan beats the plain step by the margin (priced
    # below it, one draft at 1.8 did, by 5x)
    assert policy.plan([[0.5, 0.5]] * 16, count=True, per_request=True) == [0] * 16


def test_ragged_lengths_give_each_request_its_own_drafts():
    # rows cost 0.1 each beside a fixed 1 per step: a draft accepted with probability p
    # adds p tokens for 0.1 more; the HIGH requests draft 3, the LOW ones none, in one step
    policy = ragged_costed(0.1)
    mixed = [HIGH, LOW] * 8
    plan = policy.plan(mixed, count=True, per_request=True)
    assert plan == [3, 0] * 8
    # rows dearer than the drafts are worth: (1 + 0.9 a) / (1 + per_row (1 + k)) loses
    policy = ragged_costed(10.0)
    assert policy.plan([[0.5] * 3] * 4, count=True, per_request=True) == [0] * 4
    # a middling request drafts only its likely drafts: 0.9, 0.45, 0.05
    policy = ragged_costed(0.2)
    plan = policy.plan([[0.9, 0.5, 0.1]] + [HIGH] * 3, count=True, per_request=True)
    assert plan[1:] == [3, 3, 3] and 1 <= plan[0] <= 2


def test_ragged_exploration_gives_a_zero_one_draft_and_measures_the_plain_step():
    """Every EXPLORE_EVERY plans: one gives the requests at 0 a draft, and one runs the plain
    step while fewer than PLAIN_SAMPLES of its steps in the bucket were timed, whatever its
    price (6.2 tokens per unit against the plan's 8 here; the same at a tenth of that);
    measured and below EXPLORE_WITHIN of the plan, it is not run."""
    policy = ragged_costed(0.1)
    mixed = [HIGH, LOW] * 8
    seen = [policy.plan(mixed, count=True, per_request=True) for _ in range(EXPLORE_EVERY)]
    assert seen.count([3, 1] * 8) == 1
    assert seen.count([0] * 16) == 1
    assert seen.count([3, 0] * 8) == EXPLORE_EVERY - 2
    for _ in range(PLAIN_SAMPLES - 1):  # measured, as profiled, but on too few steps
        policy.costs.observe(16, 0, policy.costs.profile[16, 0])
    seen = [policy.plan(mixed, count=True, per_request=True) for _ in range(EXPLORE_EVERY)]
    assert seen.count([0] * 16) == 1
    policy.costs.observe(16, 0, policy.costs.profile[16, 0])
    seen = [policy.plan(mixed, count=True, per_request=True) for _ in range(EXPLORE_EVERY)]
    assert seen.count([0] * 16) == 0 and seen.count([3, 0] * 8) == EXPLORE_EVERY - 1
    # a plain step priced far off, at ten times its profile (a tenth of the plan's rate),
    # but on fewer than PLAIN_SAMPLES steps: explored all the same
    far = ragged_costed(0.1)
    far.costs.observe(16, 0, 10 * far.costs.profile[16, 0])
    seen = [far.plan(mixed, count=True, per_request=True) for _ in range(EXPLORE_EVERY)]
    assert seen.count([0] * 16) == 1


def test_ragged_plans_with_no_drafts_explore_the_longest_contender():
    """Where no plan with drafts pays by the margin (0.3 per position: K = 1 promises 1.01x of
    the plain step), a plan now and then drafts the largest K within EXPLORE_WITHIN of
    the plain step's tokens per second for every request (K = 2: 0.88x; K = 3: 0.76x), once
    per EXPLORE_EVERY x 4 plans of four requests (as many request-steps as a lone request's)."""
    policy = ragged_costed(0.1)
    estimates = [[0.3] * 3] * 4
    plans = 8 * EXPLORE_EVERY
    seen = [policy.plan(estimates, count=True, per_request=True) for _ in range(plans)]
    assert seen.count([2] * 4) == 2 and seen.count([0] * 4) == plans - 2
    assert seen[4 * EXPLORE_EVERY - 1] == [2] * 4


def exhaustive_plan(policy: AdaptiveDraftLength, estimates) -> list[int]:
    """The ragged plan by scanning every prefix of every K's ranking (no pruning): the
    reference `_ragged_lengths` must equal, exploration aside."""
    n, costs = len(estimates), policy.costs
    bucket = costs.bucket(n)
    best, plan = policy.margin * n / costs.cost(bucket, 0), [0] * n
    for k in costs.ks[1:]:
        gains = []
        for r, e in enumerate(estimates):
            run = 1.0
            for j in range(k):
                run *= e[j]
                gains.append((-run, j, r))
        gains.sort()
        priced = costs.ragged_costs(bucket, k, n)
        tokens, take = float(n), 0
        for m, (gain, _, _) in enumerate(gains, 1):
            tokens -= gain
            if tokens / priced[m] > best:
                best, take = tokens / priced[m], m
        if take:
            plan = [0] * n
            for _, _, r in gains[:take]:
                plan[r] += 1
    return plan


def test_ragged_plans_skip_only_ks_that_cannot_win():
    """`_ragged_lengths` skips a K whose every draft at the price of one cannot beat the best
    plan so far: its plans equal the exhaustive scan's, over random acceptance (low, high,
    mixed, requests sharing estimates: ties broken alike), row prices and served scales, the
    row profile given out of order included."""
    import random

    rng = random.Random(7)
    for trial in range(300):
        per_row = rng.choice([0.001, 0.01, 0.05, 0.2, 1.0])
        policy = ragged_costed(per_row)
        if trial % 3 == 0:  # a noisy row profile: never less for more rows once tabled
            noisy = {n: n * per_row * rng.uniform(0.5, 1.5) for n in (1, 2, 4, 8, 16, 32, 64)}
            policy.costs = CostTable(BUCKETS, 3, policy.costs.profile, noisy)
            table = policy.costs.row_seconds
            assert all(a <= b for a, b in zip(table, table[1:]))
        for k in range(4):
            if rng.random() < 0.5:
                policy.costs.observe(8, k, rng.uniform(0.5, 3.0) * policy.costs.cost(8, k))
        n = rng.choice([1, 3, 8, 16, 40])
        top = rng.choice([0.05, 0.5, 1.0])
        estimates = [[rng.uniform(0, top) for _ in range(3)] for _ in range(n)]
        if trial % 4 == 1:  # ties: requests sharing a few estimates (a kind's prior)
            estimates = [rng.choice(estimates[:2]) for _ in range(n)]
        policy.plans = 1  # not an exploring plan
        assert policy._ragged_lengths(estimates) == exhaustive_plan(policy, estimates), trial


def test_overlapped_rounds_cycle_through_exploration():
    """An overlapped round plans uncounted (`count=False`) and `advance`s once it launches:
    its plans still cycle, one zeros-draft plan and one plain step per EXPLORE_EVERY rounds,
    never the same exploring plan round after round."""
    policy = ragged_costed(0.1)
    mixed = [HIGH, LOW] * 8
    seen = []
    for _ in range(2 * EXPLORE_EVERY):
        seen.append(policy.plan(mixed, count=False, per_request=True))
        policy.advance(len(mixed))
    assert seen.count([3, 1] * 8) == 2 and seen.count([0] * 16) == 2
    assert seen.count([3, 0] * 8) == 2 * EXPLORE_EVERY - 4


def test_drafts_past_a_requests_last_token_expect_nothing():
    """`capped`: a request with m drafts left expects no token from drafts past m, so the
    ragged plan gives it at most m rows of drafts; its own estimate is left as it was."""
    own = Estimate([0.9, 0.8, 0.7], "sampled")
    assert capped(own, 3) is own and capped(own, 5) is own
    two = capped(own, 2)
    assert two == [0.9, 0.8, 0.0] and two.kind == "sampled" and own == [0.9, 0.8, 0.7]
    assert capped(own, 0) == [0.0] * 3 and capped(own, -1) == [0.0] * 3
    policy = ragged_costed(0.1)
    plan = policy.plan([capped(HIGH, 1), capped(HIGH, 0), HIGH], count=True, per_request=True)
    assert plan == [1, 0, 3]
