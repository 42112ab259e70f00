"""Graphs under data-parallel attention (model_executor/dp_graph.py): the choice every rank
makes from the exchanged demands, and what a rank states (its demand, the static batch's fixed
DP token counts, an idle group's replay over padding only) through a real graph runner."""

from __future__ import annotations

import pytest
import torch
from test_graph_runner import Requests, make_runner

from srt_ascend.model_executor.dp_graph import NO_GRAPH, agree_replay, demand, token_counts
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.server_args import ServerArgs

DECODE, VERIFY = 0, 1  # kind indices


def test_busy_groups_share_the_largest_bucket_and_idle_groups_follow():
    assert agree_replay([demand(3, DECODE, 4), demand(8, DECODE, 8)]) == (DECODE, 8)
    assert agree_replay([demand(0), demand(2, VERIFY, 1), demand(0)]) == (VERIFY, 1)
    assert agree_replay([demand(5, VERIFY, 2), demand(0)]) == (VERIFY, 2)


@pytest.mark.parametrize(
    "demands",
    [
        [demand(40), demand(2, DECODE, 2)],  # a prefill, or a batch no bucket holds
        [demand(2, DECODE, 2), demand(6, VERIFY, 2)],  # different kinds: ranks out of step
        [demand(0), demand(0)],  # every group idle: no MLP collective to pair
    ],
)
def test_every_rank_runs_eagerly_unless_every_busy_group_can_replay_one_kind(demands):
    assert agree_replay(demands) is None


def test_demands_carry_the_token_counts_the_eager_gather_uses():
    demands = [demand(7), demand(0), demand(3, DECODE, 4)]
    assert token_counts(demands) == [7, 0, 3]
    assert demand(7) == [7, NO_GRAPH, 0]  # no kind or no bucket: nothing to replay


def test_graphs_run_with_dp_attention_but_not_with_the_all_to_all_dispatch():
    from srt_ascend.platforms import get_platform

    cpu = get_platform("cpu")
    dp = {"tp_size": 2, "enable_dp_attention": True, "dp_size": 2, "enable_cpu_graph": True}
    assert ServerArgs(**dp).graphs_enabled(cpu)
    a2a = {**dp, "ep_size": 2, "moe_a2a_backend": "all_to_all"}
    assert not ServerArgs(**a2a).graphs_enabled(cpu)


@pytest.fixture(scope="module")
def runner(tiny_mtp_factory):
    return make_runner(tiny_mtp_factory(num_mtp=2).path, "expand")


def test_a_rank_demands_its_kind_and_smallest_bucket(runner):
    gr = runner.graph_runner
    reqs = Requests(runner, lens=(5, 11, 8))
    try:
        decode = reqs.kind("decode")
        fb = reqs.batch("decode")
        index, bucket = gr.demand(fb, decode)[1:]
        assert gr.kind_at(index) is decode and bucket == 4  # 3 requests: buckets are (2, 4)
        assert gr.demand(fb, None) == demand(3)  # a forward no decoder names a kind for
        prefill = reqs.batch("decode")
        prefill.forward_mode = ForwardMode.EXTEND
        assert gr.demand(prefill, decode) == demand(3)
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)


def test_an_idle_group_replays_the_agreed_graph_over_padding_only(runner):
    """What an idle DP group runs: the agreed kind's graph at the agreed bucket with no real
    row; it writes KV only to the padding slot (0) and returns no rows."""
    gr, pool = runner.graph_runner, runner.kv_pool
    for name, layer in (("decode", None), ("draft_extend", 0)):
        kind = runner.kinds[name]
        before = [pool.get_key_buffer(i).clone() for i in range(runner.num_layers)]
        none = torch.empty(0, dtype=torch.int64)
        idle = runner.build_forward_batch(ForwardMode.IDLE, none, [], [], [], none)
        hidden = (
            None if layer is None else torch.empty(0, runner.config.hidden_size, dtype=runner.dtype)
        )
        replays = gr.replays[name]
        out = gr.try_replay(idle, kind, hidden, bucket=4)
        assert out.shape == (0, runner.config.hidden_size) and gr.replays[name] == replays + 1
        for i, kv in enumerate(before):
            after = pool.get_key_buffer(i)
            assert torch.equal(after[1:], kv[1:]), f"idle replay wrote KV of layer {i}"


def test_a_batch_replays_at_a_larger_agreed_bucket(runner):
    """A group whose batch is smaller than another's replays the agreed (larger) bucket: its
    rows equal the eager forward's."""
    gr = runner.graph_runner
    reqs = Requests(runner, lens=(5, 11))
    try:
        fb = reqs.batch("decode")
        kind = reqs.kind("decode")
        assert gr.bucket_for(fb, kind) == 2
        replayed = gr.try_replay(fb, kind, bucket=4)
        torch.testing.assert_close(replayed, runner.forward_eager(fb), rtol=1e-4, atol=1e-5)
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)
