"""Adaptive draft length on synthetic costs: the cost table (buckets, warm-up, windowed median,
re-measurement), the acceptance estimates, and the policy's choice of K; the metrics it
exports and the flags."""

from __future__ import annotations

import pytest

from srt_ascend.metrics import ServerMetrics
from srt_ascend.server_args import ServerArgs, prepare_server_args
from srt_ascend.speculative.draft_length import (
    ACCEPT_WEIGHT,
    COST_WINDOW,
    EXPLORE_EVERY,
    WARM_SAMPLES,
    AcceptanceStats,
    AdaptiveDraftLength,
    CostTable,
    FixedDraftLength,
    expected_tokens,
    update_estimate,
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


def warmed(max_k: int, seconds=step_seconds) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength(max_k, BUCKETS)
    for b in BUCKETS:
        for k in range(max_k + 1):
            for _ in range(WARM_SAMPLES):
                policy.costs.observe(b, k, seconds(b, k))
    return policy


def test_expected_tokens_is_one_plus_the_survival_sum() -> None:
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_cost_table_buckets_and_windowed_median() -> None:
    table = CostTable(BUCKETS, 2)
    assert [table.bucket(n) for n in (1, 3, 9, 16, 40)] == [1, 4, 16, 16, 16]
    table.observe(3, 1, 10.0)  # a cold start
    table.observe(4, 1, 2.0)
    assert table.seconds[4, 1] == 2.0  # lower median of (10, 2)
    table.observe(4, 1, 2.0)
    table.observe(4, 1, 6.0)  # a spike
    assert table.seconds[4, 1] == 2.0
    for _ in range(COST_WINDOW):  # the step really became slower: the window forgets 2.0
        table.observe(4, 1, 3.0)
    assert table.seconds[4, 1] == 3.0
    assert table.snapshot() == {"4": {"1": 3.0}}


def test_every_entry_is_measured_then_the_stalest_is_remeasured() -> None:
    table = CostTable(BUCKETS, 2)
    asked = []
    while (k := table.to_measure(8)) is not None:
        asked.append(k)
        table.observe(8, k, 1.0)
    assert asked == [2, 2, 1, 1, 0, 0]  # largest K first, each WARM_SAMPLES times
    table.observe(8, 1, 1.0)  # K = 2 is now the entry measured longest ago
    picks = [table.to_measure(8) for _ in range(EXPLORE_EVERY)]
    assert [k for k in picks if k is not None] == [2]


def test_a_new_bucket_measures_k0_and_borrows_the_rest() -> None:
    table = CostTable(BUCKETS, 2)
    for k, seconds in ((0, 1.0), (1, 1.5), (2, 2.5)):
        for _ in range(WARM_SAMPLES):
            table.observe(1, k, seconds)
    asked = []
    while (k := table.to_measure(16)) is not None:
        asked.append(k)
        table.observe(16, k, 4.0)  # K = 0 costs 4x bucket 1's here
    assert asked == [0, 0]
    assert table.cost(16, 1) == 6.0 and table.cost(16, 2) == 10.0  # scaled by 4
    assert table.cost(4, 1) is None  # nothing measured in bucket 4: no estimate
    picks = [table.to_measure(16) for _ in range(EXPLORE_EVERY - 2)]
    assert [k for k in picks if k is not None] == [1]  # the stalest: never measured
    table.observe(16, 1, 9.0)  # measured: the estimate gives way
    assert table.cost(16, 1) == 9.0 and table.to_measure(16) == 1  # its second sample


def test_acceptance_stats_and_estimates_count_examined_positions_only() -> None:
    stats = AcceptanceStats(3)
    stats.record(3, 1)  # d_1 accepted, d_2 rejected, d_3 never examined
    stats.record(2, 2)  # both accepted
    stats.record(0, 0)  # no drafts
    assert stats.drafted == [2, 2, 0] and stats.accepted == [2, 1, 0]
    assert stats.rates()[:2] == [1.0, 0.5]
    estimate = [0.5, 0.5, 0.5]
    update_estimate(estimate, 3, 1)
    assert estimate == pytest.approx([0.5 + ACCEPT_WEIGHT * 0.5, 0.5 - ACCEPT_WEIGHT * 0.5, 0.5])


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
    policy = warmed(3)
    estimates = [[acceptance] * 3 for _ in range(batch)]
    bucket = policy.costs.bucket(batch)

    def rate(k: int) -> float:
        return batch * expected_tokens([acceptance] * 3, k) / step_seconds(bucket, k)

    assert max(range(4), key=rate) == want
    assert policy.choose(estimates) == want


def test_policy_learns_from_recorded_steps() -> None:
    policy = warmed(2)
    estimates = [[0.9, 0.9]]
    assert policy.choose(estimates) == 2
    for _ in range(30):  # K = 2 turns out slow in bucket 1; estimates stay high
        policy.record(estimates, 2, [2], 100.0)
    assert policy.choose(estimates) == 1
    assert policy.stats()["spec_draft_length_steps"] == {"2": 30}
    low = [[0.0, 0.0]]
    for _ in range(20):  # a request whose drafts are always rejected
        policy.record(low, 1, [0], step_seconds(1, 1))
    assert low[0][0] < 0.01 and policy.choose(low) == 0


def test_fixed_policy_always_runs_k_and_keeps_the_counters() -> None:
    policy = FixedDraftLength(2, BUCKETS)
    estimates = [policy.initial_estimate() for _ in range(3)]
    assert policy.choose(estimates) == 2
    policy.record(estimates, 2, [0, 1, 2], 0.1)
    assert policy.acceptance.drafted == [3, 2] and policy.acceptance.accepted == [2, 1]
    assert policy.stats() == {"spec_draft_length_steps": {"2": 1}}


def test_metrics_export_chosen_k_acceptance_and_costs() -> None:
    metrics = ServerMetrics("m", spec_enabled=True)
    policy = warmed(1)
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
