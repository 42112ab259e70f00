"""Adaptive draft length on synthetic costs: the start profile, the cost table (buckets,
windowed median, profile scaled by what serving measured), the acceptance estimates, the
policy's choice of K and its exploration of the runner-up; the metrics it exports and the
flags."""

from __future__ import annotations

import random

import pytest

from srt_ascend.metrics import ServerMetrics
from srt_ascend.server_args import ServerArgs, prepare_server_args
from srt_ascend.speculative import draft_length, step_costs
from srt_ascend.speculative.draft_length import (
    ESTIMATE_DECAY,
    EXPLORE_EVERY,
    EXPLORE_UNMEASURED,
    EXPLORE_WITHIN,
    PLAIN_EVERY,
    PLAIN_SAMPLES,
    PRIOR_WEIGHT,
    SPEC_MARGIN,
    AcceptanceStats,
    AdaptiveDraftLength,
    Estimate,
    FixedDraftLength,
    expected_tokens,
    update_estimate,
)
from srt_ascend.speculative.step_costs import (
    COST_WINDOW,
    PROFILE_MAX_RUNS,
    PROFILE_MIN_RUNS,
    CostTable,
    monotone,
    profile_costs,
)

BUCKETS = [1, 2, 4, 8, 16]


def step_seconds(bucket: int, k: int) -> float:
    """A device whose forwards are memory-bound up to 16 tokens per step, then linear in
    tokens: verify (1+K tokens per request), K-1 draft steps and the MTP pass (1+K tokens)
    at a quarter of the target's cost; K = 0 is a plain decode step (its MTP pass deferred)."""
    tokens = bucket * (1 + k)
    target = max(1.0, tokens / 16)
    if k == 0:
        return target
    return target + 0.25 * (max(1.0, tokens / 16) + (k - 1) * max(1.0, bucket / 16))


def profile(max_k: int, seconds=step_seconds) -> dict[tuple[int, int], float]:
    return {(b, k): seconds(b, k) for b in BUCKETS for k in range(max_k + 1)}


def profiled(max_k: int, seconds=step_seconds) -> AdaptiveDraftLength:
    """A policy whose start profile is `seconds` (nothing measured while serving yet)."""
    policy = AdaptiveDraftLength(max_k, BUCKETS)
    policy.calibrate(lambda b, k: clock.advance(seconds(b, k)), lambda: None)
    return policy


class _Clock:
    now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


clock = _Clock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    """profile_costs times its forwards with this clock, which the synthetic forwards move."""
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: clock.now)


def test_expected_tokens_is_one_plus_the_survival_sum() -> None:
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_profile_warms_up_runs_in_rounds_keeps_the_fastest_run_and_interpolates() -> None:
    calls = []
    slow = {(1, 0): 9.0, (4, 0): 9.0, (6, 0): 9.0}  # the first run of each: warm-up

    def forwards(b, k):
        calls.append((b, k))
        run = sum(c == (b, k) for c in calls)  # 1: warm-up, then the timed runs
        clock.advance(slow.pop((b, k), 3.0 if run % 2 else 2.5) * b * 0.005)

    # 1, 4 (a power of two) and 6 (the largest) are timed; 3 and 5 are interpolated
    got = profile_costs([1, 3, 4, 5, 6], 0, forwards, lambda: None)
    assert got == pytest.approx({(b, 0): 0.0125 * b for b in (1, 3, 4, 5, 6)})
    # warm-up round, then rounds over the entries still short of runs or of timed seconds
    n_runs = {b: sum(c == (b, 0) for c in calls) - 1 for b in (1, 4, 6)}
    assert calls[:3] == [(1, 0), (4, 0), (6, 0)] and calls[3:6] == calls[:3]
    # PROFILE_ENTRY_SECONDS (0.2 s) of runs: bucket 1 (0.0125-0.015 s a run) stops at the
    # count, bucket 4 (0.05-0.06 s) after 4 runs, bucket 6 (0.075-0.09 s) after 3
    assert n_runs == {1: PROFILE_MAX_RUNS, 4: 4, 6: 3} and PROFILE_MIN_RUNS <= 3


def test_profile_entries_never_exceed_a_larger_step() -> None:
    # a burst of interference made (1, 1) and (2, 0) slower than steps over more tokens
    costs = {(1, 0): 1.0, (1, 1): 5.0, (2, 0): 4.0, (2, 1): 3.0, (4, 0): 2.5, (4, 1): 6.0}
    assert monotone(costs) == {
        (1, 0): 1.0,
        (1, 1): 3.0,  # capped by (2, 1)
        (2, 0): 2.5,  # capped by (4, 0)
        (2, 1): 3.0,
        (4, 0): 2.5,
        (4, 1): 6.0,
    }


def test_costs_are_the_profile_scaled_by_what_serving_measures() -> None:
    prof = {(b, k): b * (1.0 + k) for b in BUCKETS for k in range(3)}
    table = CostTable(BUCKETS, 2, prof)
    assert [table.bucket(n) for n in (1, 3, 9, 16, 40)] == [1, 4, 16, 16, 16]
    assert table.cost(4, 2) == 12.0  # nothing measured: the profile itself
    table.observe(3, 2, 18.0)  # a K = 2 step in bucket 4 runs 1.5x its profile
    assert table.measured(4, 2) and not table.measured(4, 0)
    assert table.observations(4, 2) == 1 and table.observations(4, 0) == 0
    # the bucket's other K with drafts borrow its scale, other buckets the nearest bucket's;
    # the plain step borrows no drafting step's scale: no plain step measured, its profile
    assert [table.cost(4, k) for k in range(3)] == [4.0, 12.0, 18.0]
    assert table.cost(16, 1) == 48.0 and table.cost(1, 0) == 1.0
    table.observe(4, 0, 4.4)  # K = 0 measured: 1.1x, its own scale from now on
    assert table.cost(4, 0) == pytest.approx(4.4) and table.cost(4, 2) == 18.0
    assert table.cost(4, 1) == pytest.approx(8 * 1.1)  # median_low(1.1, 1.5)
    # the other buckets' plain steps borrow it (the nearest bucket's plain step's)
    assert table.cost(1, 0) == pytest.approx(1.1) and table.cost(16, 0) == pytest.approx(17.6)
    table.observe(4, 0, 40.0)  # a spike: the lower median of (1.1, 10) keeps 1.1
    assert table.cost(4, 0) == pytest.approx(4.4)
    table.observe(4, 0, 4.8)  # 1.2x
    assert table.cost(4, 0) == pytest.approx(4.8)  # median_low(1.1, 10, 1.2) = 1.2
    for _ in range(COST_WINDOW):  # K = 0 really got slower: the window forgets the rest
        table.observe(4, 0, 8.0)
    assert table.cost(4, 0) == 8.0
    table.observe(4, 0, 6.0)  # a drop is believed at once: the latest, 1.5x, is lower
    assert table.cost(4, 0) == 6.0
    table.observe(4, 0, 8.0)  # and the window's lower median holds again after it
    assert table.cost(4, 0) == 8.0
    table.observe(16, 0, 1.0)  # far below its profile: never below half of it
    assert table.cost(16, 0) == 8.0
    assert table.snapshot()["4"] == {"0": 8.0, "1": 12.0, "2": 18.0}  # median_low(2, 1.5)
    with pytest.raises(ValueError, match="lacks"):
        CostTable([1, 4], 1, {(1, 0): 1.0, (1, 1): 1.0, (4, 0): 1.0})


def test_a_compute_bound_bucket_never_drafts_and_its_prefills_defer() -> None:
    policy = profiled(3)  # bucket 16: K = 3 costs about twice K = 0
    estimates = [[0.3] * 3 for _ in range(16)]
    ran = []
    for _ in range(100):
        k = policy.choose(estimates)
        ran.append(k)
        policy.record(estimates, k, [0] * 16, step_seconds(16, k) + 0.5)
    assert set(ran) == {0}  # no larger K is run only to measure it
    assert policy.prefers_plain(16) and not policy.prefers_plain(1)
    assert not FixedDraftLength(3, BUCKETS).prefers_plain(16)


def test_acceptance_stats_and_estimates_count_examined_positions_only() -> None:
    stats = AcceptanceStats(3)
    stats.record(3, 1)  # d_1 accepted, d_2 rejected, d_3 never examined
    stats.record(2, 2)  # both accepted
    stats.record(0, 0)  # no drafts
    assert stats.drafted == [2, 2, 0] and stats.accepted == [2, 1, 0]
    assert stats.rates()[:2] == [1.0, 0.5]
    estimate = Estimate([0.5, 0.5, 0.5])
    update_estimate(estimate, 3, 1)
    first = 1 / (PRIOR_WEIGHT * ESTIMATE_DECAY + 1)  # the first outcome's weight
    assert estimate == pytest.approx([0.5 + first * 0.5, 0.5 - first * 0.5, 0.5])
    fixed = [0.5, 0.5, 0.5]  # a plain list has no counts: held as it is
    update_estimate(fixed, 3, 1)
    assert fixed == [0.5, 0.5, 0.5]


def test_estimates_move_fast_while_new_and_slower_once_established() -> None:
    old = Estimate([0.5])
    weights = []  # each outcome's weight: how far it moves the estimate towards itself
    for _ in range(30):
        before = old[0]
        update_estimate(old, 1, 1)
        weights.append((old[0] - before) / (1 - before))
    assert weights[0] == pytest.approx(1 / (PRIOR_WEIGHT * ESTIMATE_DECAY + 1))
    assert all(a > b for a, b in zip(weights, weights[1:]))  # falling with the evidence
    assert weights[-1] == pytest.approx(1 - ESTIMATE_DECAY, abs=0.01)
    assert old[0] > 0.95
    for _ in range(20):  # no floor left by the prior: a request that stops accepting
        update_estimate(old, 1, 0)
    assert old[0] < 0.15


def test_a_new_request_starts_from_its_kinds_recent_acceptance() -> None:
    policy = FixedDraftLength(2, BUCKETS)
    prior, w = draft_length.PRIOR_ACCEPT, PRIOR_WEIGHT
    assert policy.initial_estimate("greedy") == [prior] * 2  # none yet
    for _ in range(50):
        code, chat = policy.initial_estimate("greedy"), policy.initial_estimate("sampled")
        policy.record([code, chat], 2, [2, 0], None)
    # the server's rates beside PRIOR_WEIGHT outcomes at PRIOR_ACCEPT: 50 of 100 first drafts
    # accepted, 50 of 50 second ones (only the greedy requests reached them)
    server = [(50 + w * prior) / (100 + w), (50 + w * prior) / (50 + w)]
    assert policy.initial_estimate("") == pytest.approx(server)
    # each kind's decayed counts (n outcomes) beside PRIOR_WEIGHT at PRIOR_ACCEPT
    n = sum(draft_length.KIND_DECAY**i for i in range(50))
    greedy = [(n + w * prior) / (n + w)] * 2
    assert policy.initial_estimate("greedy") == pytest.approx(greedy)
    assert min(greedy) > 0.99
    # the sampled requests never reached position 2: the server-wide rate there
    sampled = [w * prior / (n + w), server[1]]
    assert policy.initial_estimate("sampled") == pytest.approx(sampled)
    assert sampled[0] < 0.07
    for _ in range(5000):  # the kind's rate follows its recent requests
        policy.record([policy.initial_estimate("sampled")], 2, [2], None)
    assert policy.initial_estimate("sampled")[0] > 0.99


def test_a_kinds_first_outcomes_do_not_settle_its_prior() -> None:
    """Served: a lone request's first two steps of K = 3 (1 and 2 drafts accepted) left the
    greedy kind at [1.0, 0.5, 0.0] without the PRIOR_WEIGHT outcomes beside them; every later
    request then started there and planned no drafts."""
    policy = FixedDraftLength(3, BUCKETS)
    est = policy.initial_estimate("greedy")
    policy.record([est], 3, [1], None)
    policy.record([est], 3, [2], None)
    start = policy.initial_estimate("greedy")
    assert 0.9 < start[0] < 1.0 and 0.6 < start[1] < 0.8 and 0.6 < start[2] < 0.8
    assert expected_tokens(start, 3) > 3.0  # 2.5 from [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("batch", "acceptance", "want"),
    [
        (1, 0.9, 3),  # memory-bound and accepted often: the longest chain
        (1, 0.05, 0),  # rarely accepted: the MTP pass does not pay for itself
        (16, 0.9, 0),  # compute-bound: every extra token costs its share
        (4, 0.7, 2),  # 16 tokens still fit the flat part, but the third draft step does not pay
        (4, 0.9, 3),  # ... unless it is accepted often
        (8, 0.8, 1),  # 8 * 2 = 16 tokens: one draft is free, two are not
    ],
)
def test_policy_maximises_expected_tokens_per_second(batch, acceptance, want) -> None:
    policy = profiled(3)
    estimates = [[acceptance] * 3 for _ in range(batch)]
    bucket = policy.costs.bucket(batch)

    def rate(k: int) -> float:
        return batch * expected_tokens([acceptance] * 3, k) / step_seconds(bucket, k)

    assert max(range(4), key=rate) == want
    assert policy.choose(estimates) == want


def test_drafts_must_promise_a_margin_over_plain_decoding() -> None:
    policy = profiled(1, lambda b, k: (1.0, 1.7)[k])  # K = 1 costs 1.7x a plain step
    assert SPEC_MARGIN == 1.15
    assert policy.choose([[0.95]]) == 0  # 1.95 / 1.7: 1.147x K = 0's tokens per second
    assert policy.choose([[1.0]]) == 1  # 2 / 1.7: 1.176x
    assert policy.prefers_plain(1)  # the prior acceptance, 0.9: 1.9 / 1.7


def test_policy_learns_from_recorded_steps() -> None:
    policy = profiled(2)
    estimates = [policy.initial_estimate()]  # an optimistic prior: drafting gets tried
    assert policy.choose(estimates) == 2
    for _ in range(COST_WINDOW):  # K = 2 steps take twice their profile when served
        policy.record(estimates, 2, [2], 2 * step_seconds(1, 2))
    assert policy.costs.cost(1, 1) == pytest.approx(2 * step_seconds(1, 1))  # borrowed
    # the plain step borrows no drafting step's scale: at its profile it wins, and runs
    assert policy.costs.cost(1, 0) == pytest.approx(step_seconds(1, 0))
    assert policy.choose(estimates) == 0
    for _ in range(COST_WINDOW):  # served, it too takes twice its profile
        policy.record(estimates, 0, [0], 2 * step_seconds(1, 0))
    assert policy.choose(estimates) == 2  # the same factor for every K: K = 2 again
    before = policy.costs.snapshot()
    policy.record(estimates, 2, [2], None)  # a step right after a prefill: not timed
    assert policy.costs.snapshot() == before and policy.chosen[2] == COST_WINDOW + 1
    low = [policy.initial_estimate()]
    for _ in range(20):  # a request whose drafts are always rejected
        policy.record(low, 1, [0], 2 * step_seconds(1, 1))
    assert low[0][0] < 0.2 and policy.choose(low) == 0
    steps = {"0": COST_WINDOW, "1": 20, "2": COST_WINDOW + 1}
    assert policy.stats()["spec_draft_length_steps"] == steps


def test_the_runner_up_runs_now_and_then_and_corrects_a_wrong_entry() -> None:
    # the profile says K = 1 costs 1.5x a plain step; served, it costs 3x (K = 0: 1x)
    policy = profiled(1, lambda b, k: (1.0, 1.5)[k])
    served = {0: 1.0, 1: 3.0}
    estimates = [[0.9]]
    ran = []
    for _ in range(4 * EXPLORE_EVERY):
        k = policy.choose(estimates)
        ran.append(k)
        policy.record(estimates, k, [1] * k, served[k])
        estimates[0][0] = 0.9  # hold the acceptance still
    # K = 1 first (1.9 tokens / 1.5 s); measured at 3 s it loses to K = 0 (1.9 / 3 < 1 / 1),
    # priced at its profile (a plain step borrows no drafting step's scale): K = 0 runs from
    # the second step on, and K = 1 is the runner-up at 0.63x of its rate: not a contender,
    # never run again
    assert ran == [1] + [0] * (4 * EXPLORE_EVERY - 1)
    assert policy.costs.cost(1, 1) == 3.0 and policy.costs.cost(1, 0) == 1.0
    # had K = 0 borrowed K = 1's scale (2 s: 0.79x of K = 1's rate) it would not run by its
    # price; the bucket's EXPLORE_EVERY-th step runs it while it has fewer than
    # PLAIN_SAMPLES timed steps there, whatever its price
    stuck = profiled(1, lambda b, k: (1.0, 1.5)[k])
    stuck.costs.observe(1, 1, 3.0)
    stuck.costs.observe(1, 0, 2.0)  # measured once, in a slow spell: 2x its profile
    ran = []
    for _ in range(4 * EXPLORE_EVERY):
        k = stuck.choose(estimates)
        ran.append(k)
        stuck.record(estimates, k, [1] * k, served[k])
        estimates[0][0] = 0.9
    assert ran[: EXPLORE_EVERY - 1] == [1] * (EXPLORE_EVERY - 1)
    assert ran[EXPLORE_EVERY - 1] == 0  # the second sample, 1 s, the latest and lower
    assert set(ran[EXPLORE_EVERY:]) == {0} and EXPLORE_UNMEASURED < 0.79 < EXPLORE_WITHIN
    # measured on PLAIN_SAMPLES steps or more, all in a slow spell (2.5 s: 0.63x of K = 1's
    # rate, no contender): every PLAIN_EVERY-th step of the bucket runs it all the same, and
    # its latest time, lower, is its price from then on
    slow = profiled(1, lambda b, k: (1.0, 1.5)[k])
    for _ in range(PLAIN_SAMPLES):
        slow.costs.observe(1, 0, 2.5)
    slow.costs.observe(1, 1, 3.0)
    ran = []
    for _ in range(PLAIN_EVERY + EXPLORE_EVERY):
        k = slow.choose(estimates)
        ran.append(k)
        slow.record(estimates, k, [1] * k, served[k])
        estimates[0][0] = 0.9
    assert ran[: PLAIN_EVERY - 1] == [1] * (PLAIN_EVERY - 1)
    assert set(ran[PLAIN_EVERY - 1 :]) == {0} and slow.costs.cost(1, 0) == 1.0
    # a smaller runner-up within reach of the best runs once every EXPLORE_EVERY steps
    close = profiled(1, lambda b, k: (1.0, 1.9 / 1.2)[k])  # K = 1: 1.2x K = 0's rate
    picks = [close.choose([[0.9]]) for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(0) == 2 and picks[EXPLORE_EVERY - 1] == 0


def test_where_no_draft_pays_the_longest_contender_runs_now_and_then() -> None:
    """K = 0 the best (by the margin): every EXPLORE_EVERY x b-th step of bucket b runs the
    largest K within EXPLORE_WITHIN of K = 0's tokens per second, so that the estimates, which
    no K = 0 step moves, are measured again (none where no K is within reach:
    test_a_compute_bound_bucket_never_drafts_and_its_prefills_defer)."""
    policy = profiled(3)  # bucket 1: K = 0, 1, 2, 3 cost 1, 1.25, 1.5, 1.75
    low_first = [[0.2, 0.9, 0.9]]  # 0.96, 0.92, 0.88 of K = 0's rate: K = 0 by the margin
    ran = [policy.choose(low_first) for _ in range(2 * EXPLORE_EVERY)]
    assert ran[EXPLORE_EVERY - 1] == ran[-1] == 3 and ran.count(3) == 2
    assert set(ran) == {0, 3}
    hopeless = profiled(3)
    ran = [hopeless.choose([[0.05, 0.05, 0.05]]) for _ in range(2 * EXPLORE_EVERY)]
    assert ran.count(1) == 2 and set(ran) == {0, 1}  # K = 1: 0.84 of K = 0's rate; K = 2: 0.70
    # two requests: as many request-steps apart, every 2 x EXPLORE_EVERY-th step of bucket 2
    pair = profiled(3)
    ran = [pair.choose(low_first * 2) for _ in range(4 * EXPLORE_EVERY)]
    assert ran.count(3) == 2 and ran[2 * EXPLORE_EVERY - 1] == 3, ran


def test_fixed_policy_always_runs_k_and_keeps_the_counters() -> None:
    policy = FixedDraftLength(2, BUCKETS)
    estimates = [policy.initial_estimate() for _ in range(3)]
    assert policy.choose(estimates) == 2
    policy.record(estimates, 2, [0, 1, 2], 0.1)
    assert policy.acceptance.drafted == [3, 2] and policy.acceptance.accepted == [2, 1]
    assert policy.stats() == {"spec_draft_length_steps": {"2": 1}}


def test_metrics_export_chosen_k_acceptance_and_costs() -> None:
    metrics = ServerMetrics("m", spec_enabled=True)
    policy = profiled(1)
    state = {
        "num_running_reqs": 0,
        "num_queue_reqs": 0,
        "cache_hit_rate": 0.0,
        "max_total_num_tokens": 10,
        "available_kv_tokens": 10,
        "spec_accepted_per_position": [3],
        "spec_acceptance_per_position": [0.75],
        "spec_draft_length_steps": {"0": 2, "1": 4},
        **{k: v for k, v in policy.stats().items() if k == "spec_step_cost_seconds"},
    }
    text = metrics.render(state).decode()
    assert 'sglang:spec_draft_length_steps_total{k="1",model_name="m"} 4.0' in text
    assert 'sglang:spec_acceptance_rate{model_name="m",position="0"} 0.75' in text
    cost = step_seconds(16, 1)
    assert f'sglang:spec_step_cost_seconds{{bucket="16",k="1",model_name="m"}} {cost}' in text


def test_flags_parse_and_reject_what_cannot_run() -> None:
    args = prepare_server_args(
        ["--speculative-algorithm", "MTP", "--speculative-adaptive"]
        + ["--speculative-accept-method", "block"]
    )
    assert args.speculative_adaptive and args.speculative_accept_method == "block"
    assert not prepare_server_args([]).speculative_adaptive
    with pytest.raises(ValueError, match="--speculative-adaptive needs --tp-size 1"):
        ServerArgs(speculative_algorithm="MTP", speculative_adaptive=True, tp_size=2)
    with pytest.raises(ValueError, match="--speculative-accept-method must be token or block"):
        ServerArgs(speculative_algorithm="MTP", speculative_accept_method="tree")


def test_peek_gives_the_next_choice_without_counting_a_step() -> None:
    """`peek` (an overlapped launch that may yet be refused) is what `choose` would give, and
    spends no step: the exploring step still comes once every EXPLORE_EVERY rounds run."""
    close = profiled(1, lambda b, k: (1.0, 1.9 / 1.2)[k])  # K = 1: 1.2x K = 0's rate
    for _ in range(EXPLORE_EVERY - 1):
        assert close.choose([[0.9]]) == 1
    assert [close.peek([[0.9]]) for _ in range(3)] == [0, 0, 0]  # the runner-up's turn
    assert close.choose([[0.9]]) == 0
    assert close.peek([[0.9]]) == 1
    assert FixedDraftLength(2, BUCKETS).peek([[0.9]]) == 2


def test_plan_fit_compares_each_k_with_what_the_policy_expected() -> None:
    """`spec_plan_fit`: per K, the tokens its steps emitted against the tokens the estimates
    they were planned with expected (before the step moved them), and the timed steps'
    seconds against the cost table's price at the time (before the step's own timing)."""
    policy = profiled(2)
    rows = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 32, 64)}  # a verify row costs 0.01
    policy.costs = CostTable(BUCKETS, 2, profile(2), rows)
    estimates = [Estimate([0.5, 0.5]), Estimate([1.0, 0.5])]
    priced = policy.costs.priced(2, 2)
    assert priced == policy.costs.cost(2, 2) == step_seconds(2, 2)  # nothing measured yet
    policy.record(estimates, 2, [0, 2], 3 * priced)  # expected 1.75 + 2.5, emitted 1 + 3
    policy.record(estimates, 0, [0, 0], None)  # untimed (after a prefill)
    # a ragged step: the second request drafted 1 (3 rows, not 6), priced at its rows and
    # at the scale the first step measured (3x); expected 1 + (1 + 1.0): the first request
    # drafted none, the second's first position was accepted (still 1.0)
    ragged = policy.costs.priced(2, 2, rows=3)
    assert ragged == pytest.approx((step_seconds(2, 2) - 0.06 + 0.03) * 3)
    policy.record(estimates, 2, [0, 1], ragged / 2, limits=[0, 1])
    expected = 3.0
    fit = policy.stats()["spec_plan_fit"]
    assert fit["0"] == {
        "steps": 1,
        "expected_tokens": 2.0,
        "tokens": 2.0,
        "timed_steps": 0,
        "priced_seconds": 0.0,
        "seconds": 0.0,
    }
    two = fit["2"]
    assert two["steps"] == two["timed_steps"] == 2
    assert two["expected_tokens"] == pytest.approx((1.75 + 2.5 + expected) / 2)
    assert two["tokens"] == pytest.approx((4 + 3) / 2)
    assert two["priced_seconds"] == pytest.approx((priced + ragged) / 2)
    assert two["seconds"] == pytest.approx((3 * priced + ragged / 2) / 2)


def test_sampled_batches_keep_their_own_cost_scales() -> None:
    """A batch with a sampled request prices its steps by the scales sampled batches
    measured (their verify samples), greedy batches by theirs; a sampled table that
    measured nothing yet borrows the greedy one's."""
    policy = profiled(2)
    greedy = [Estimate([0.9, 0.9], "greedy")] * 4
    mixed = [Estimate([0.9, 0.9], "sampled")] + greedy[1:]
    assert policy.table(greedy) is policy.costs and policy.table(mixed) is not policy.costs
    assert policy.table([[0.9, 0.9]] * 4) is policy.costs  # plain lists: no kind
    policy.record(greedy, 2, [2] * 4, 1.5 * step_seconds(4, 2))
    # nothing sampled measured: the greedy scale (1.5) for every entry with drafts, the
    # greedy plain step's for the plain step (none measured: its profile)
    assert policy.table(mixed).cost(4, 2) == pytest.approx(1.5 * step_seconds(4, 2))
    assert policy.table(mixed).cost(4, 0) == pytest.approx(step_seconds(4, 0))
    policy.record(greedy, 0, [0] * 4, 1.2 * step_seconds(4, 0))
    assert policy.table(mixed).cost(4, 0) == pytest.approx(1.2 * step_seconds(4, 0))
    policy.record(mixed, 2, [2] * 4, 3.0 * step_seconds(4, 2))
    assert policy.table(mixed).cost(4, 2) == pytest.approx(3.0 * step_seconds(4, 2))
    assert policy.table(greedy).cost(4, 2) == pytest.approx(1.5 * step_seconds(4, 2))
    assert policy.table(mixed) is policy.table(mixed)  # kept, until the costs are replaced
    stats = policy.stats()
    assert stats["spec_step_cost_seconds_sampled"]["4"]["2"] == pytest.approx(
        3.0 * step_seconds(4, 2)
    )
    assert stats["spec_step_cost_seconds"]["4"]["2"] == pytest.approx(1.5 * step_seconds(4, 2))
    policy.costs = CostTable(BUCKETS, 2, profile(2))
    assert policy.table(mixed).fallback is policy.costs
    assert policy.table(mixed).cost(4, 2) == pytest.approx(step_seconds(4, 2))
    # the choice follows the table: drafts that pay for greedy batches need not for sampled
    assert policy.choose(greedy) == 2
    for _ in range(COST_WINDOW):  # sampled: drafts at 4x their profile, the plain step at 1x
        policy.record(mixed, 2, [2] * 4, 4.0 * step_seconds(4, 2))
        policy.record(mixed, 1, [1] * 4, 4.0 * step_seconds(4, 1))
        policy.record(mixed, 0, [0] * 4, step_seconds(4, 0))
    assert policy.peek(mixed) == 0 and policy.peek(greedy) == 2


def test_lone_requests_leave_their_kind_measured_for_a_busier_batch() -> None:
    """The served case in miniature: lone greedy requests (true acceptance 0.86 / 0.80 / 0.71
    per position, as held-out code on the shipped checkpoint) where no K pays by the margin,
    then four at a time, where K = 3 pays 1.4x. The first lone request's first steps accept 1
    and 2 drafts (as served). The batch of four must draft: its requests start from the kind's
    acceptance, which K = 0 steps never move (before the kind's prior weight and the
    exploration from K = 0, the lone requests ran 1278 K = 0 steps, 1 with drafts, and the
    batch drafted in 5 of 40 steps)."""
    costs = {1: (1.0, 1.8, 2.4, 2.9), 4: (1.6, 2.6, 3.0, 3.4)}
    policy = profiled(3, lambda b, k: costs[1 if b < 4 else 4][k])
    rng, truth = random.Random(0), (0.86, 0.80, 0.71)
    scripted = [1, 2]

    def outcome(k: int) -> int:
        if scripted:
            return min(scripted.pop(0), k)
        n = 0
        while n < k and rng.random() < truth[n]:
            n += 1
        return n

    for _ in range(20):  # lone requests, 64 tokens each
        est, made = policy.initial_estimate("greedy"), 0
        while made < 64:
            k = policy.choose([est])
            accepted = outcome(k)
            policy.record([est], k, [accepted], None)
            made += 1 + accepted
    lone = dict(policy.chosen)
    batch = [policy.initial_estimate("greedy") for _ in range(4)]
    ran = []
    for _ in range(40):
        k = policy.choose(batch)
        accepted = [outcome(k) for _ in batch]
        policy.record(batch, k, accepted, None)
        ran.append(k)
    assert sum(k > 0 for k in ran) >= 0.9 * len(ran), (lone, ran)
