"""Adaptive draft length keeps MTP lossless: float32 greedy outputs are token-identical to
speculation off whatever K each step runs. A scripted policy walks the steps through a fixed
sequence of K (0 included: a plain decode step whose MTP pass waits for the next step with
drafts, which runs the deferred passes first), and prefills alternately run or defer their
MTP pass over the prompt (seeded sampled requests run the server's K and repeat their
tokens whatever the walk), with
either verify layout, eagerly and through the per-K graph kinds; the real policy and block
verification run the same prompts. Block verification runs only for batches with a sampled
row, so there the greedy prompts share their batches with seeded sampled requests: the greedy
rows go through `block_verify` (one-hot targets) and must still match greedy decoding."""

from __future__ import annotations

import itertools

import pytest
from lossless import GREEDY, PROMPTS, assert_same_greedy

from srt_ascend import Engine
from srt_ascend.speculative.draft_length import FixedDraftLength
from srt_ascend.speculative.step_costs import CostTable

N_PROMPTS = 24
SAMPLED = [{**GREEDY, "temperature": 1.0, "seed": s} for s in range(8)]  # block-expand's
WALK = (3, 0, 1, 2, 0, 0, 3, 1, 2, 3)
SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": 3}
CONFIGS = {  # name: (server args, K walk or None for the real policy)
    "walk-expand": ({**SPEC, "speculative_adaptive": True, "speculative_verify": "expand"}, WALK),
    "walk-fia-graphs": (
        {
            **SPEC,
            "speculative_adaptive": True,
            "speculative_verify": "fia",
            "enable_cpu_graph": True,
            "cuda_graph_bs": (1, 2, 4, 8),
            "context_length": 512,
        },
        WALK,
    ),
    "adaptive-fia": ({**SPEC, "speculative_adaptive": True}, None),
    "block-expand": ({**SPEC, "speculative_accept_method": "block"}, None),
}


class ScriptedDraftLength(FixedDraftLength):
    """Runs the steps through `walk`, over and over, and defers every other prefill's MTP
    pass; learns like the real policies."""

    def __init__(self, max_k: int, walk) -> None:
        super().__init__(max_k, [1])
        self.walk, self.at = tuple(walk), 0
        self.defer = itertools.cycle((True, False))

    def peek(self, estimates):
        return self.walk[self.at % len(self.walk)]

    def advance(self, batch):
        self.at += 1

    def prefers_plain(self, batch):
        return next(self.defer)


def _count_calls(obj, attr: str) -> list[int]:
    """Wraps obj.attr to count its calls; returns the one-element counter."""
    count, wrapped = [0], getattr(obj, attr)

    def counting(*args, **kwargs):
        count[0] += 1
        return wrapped(*args, **kwargs)

    setattr(obj, attr, counting)
    return count


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_whatever_k_each_step_runs(model_path, baseline, name):
    args, walk = CONFIGS[name]
    engine = Engine(model_path=model_path, dtype="float32", max_running_requests=12, **args)
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        if walk is not None:
            decoder.draft_length = ScriptedDraftLength(3, walk)
        elif name == "adaptive-fia":  # the real policy on costs where drafts pay (what the
            # start profile measured on a shared CPU would decide whether any step drafts)
            policy = decoder.draft_length
            buckets = policy.costs.buckets
            costs = {(b, k): 1.0 + 0.1 * k for b in buckets for k in range(4)}
            policy.costs = CostTable(buckets, 3, costs)
        prompts, params = PROMPTS[:N_PROMPTS], [GREEDY] * N_PROMPTS
        if name == "block-expand":
            calls = _count_calls(decoder, "accept")
            prompts, params = prompts + PROMPTS[: len(SAMPLED)], params + SAMPLED
        if name == "adaptive-fia":  # requests one decode step from their end draft nothing
            prompts, params = prompts + PROMPTS[:4], params + [{**GREEDY, "max_new_tokens": 2}] * 4
        outs = engine.generate(prompts, params, return_logprob=True)
        outs, short = outs[:N_PROMPTS], outs[N_PROMPTS:]
        state = engine.get_internal_state()
        if name == "walk-expand":
            _seeded_repeat(engine)
    finally:
        engine.shutdown()
    assert_same_greedy(name, outs, baseline[:N_PROMPTS])
    held = state["available_kv_tokens"] + state["cached_tokens_in_tree"]
    assert held == state["max_total_num_tokens"], "KV slots leaked"
    steps = state["spec_draft_length_steps"]
    if walk is not None:
        assert set(steps) == {str(k) for k in WALK}, steps
        # steps with drafts after K = 0 ones first ran the deferred passes, counted
        assert 0 < state["spec_catch_up_passes"] <= state["spec_catch_up_positions"]
        assert state["spec_catch_up_seconds"] > 0
    if name == "block-expand":  # fixed K: no K = 0 step to catch up after
        assert state["spec_catch_up_passes"] == 0
    if name == "adaptive-fia":  # where drafts pay, but past the last token they commit nothing
        assert [o["output_ids"] for o in short] == [b["output_ids"][:2] for b in baseline[:4]]
        assert [o["meta_info"]["spec_draft_tokens"] for o in short] == [0] * 4
        assert sum(o["meta_info"]["spec_draft_tokens"] for o in outs) > 0
    if "graphs" in name:
        replayed = {kind for kind, n in state["graph_replays"].items() if n > 0}
        assert {"verify_fia", "decode", "verify_fia_k1", "draft_extend_k1"} <= replayed
    assert sum(state["spec_accepted_per_position"]) > 0
    if name == "block-expand":
        assert calls[0] > 0, "block verification never ran"


def _seeded_repeat(engine) -> None:
    """A seeded sampled request that asks no length runs the server's K at every step while
    the policy walks its K (its draws follow its drafts), so it repeats its tokens alone and
    among greedy neighbours; one asking its own length runs that."""
    seeded = [dict(p) for p in SAMPLED[:4]]
    seeded[3]["speculative_num_steps"] = 1
    prompts = PROMPTS[:4] + PROMPTS[4:8]
    outs = engine.generate(prompts, seeded + [GREEDY] * 4)[:4]
    for i, (prompt, params, out) in enumerate(zip(PROMPTS, seeded, outs)):
        alone = engine.generate(prompt, params)
        assert alone["output_ids"] == out["output_ids"], i
        meta = out["meta_info"]
        k_r = params.get("speculative_num_steps", 3)
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_draft_tokens"] == k_r * meta["spec_verify_ct"]


def test_a_burst_is_planned_from_its_first_prefill(model_path):
    """Prompts longer than a prefill chunk prefill one chunk at a time while the others wait:
    every prefill tells the decoder the batch the burst makes (4), not the requests that have
    joined so far (0, 1, 2, 3), so the policy decides whether to defer the MTP pass over the
    prompts for the batch the next decode steps will run."""
    engine = Engine(
        model_path=model_path,
        dtype="float32",
        max_running_requests=4,
        chunked_prefill_size=64,
        speculative_adaptive=True,
        **SPEC,
    )
    seen = []
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        after_prefill = decoder.after_prefill

        def spy(reqs, starts, lens, hidden, done, next_batch):
            seen.append(next_batch)
            after_prefill(reqs, starts, lens, hidden, done, next_batch)

        decoder.after_prefill = spy
        text = "the quick brown fox jumps over the lazy dog. " * 12
        prompts = [f"{i}: {text}" for i in range(4)]
        outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 4})
    finally:
        engine.shutdown()
    assert all(len(o["output_ids"]) == 4 for o in outs)
    assert len(seen) > 4 and set(seen) == {4}, seen


def test_adaptive_k_walks_the_captured_round_graphs(model_path, baseline):
    """Adaptive K over all-greedy batches without logprobs: each step's K picks its captured
    whole-round graph (`mtp_round_k1..3`; K = 0 the plain decode graph), never a per-forward
    verify, and the tokens equal the eager speculation-off baseline."""
    args, walk = CONFIGS["walk-fia-graphs"]
    # at most the largest bucket runs at once: every step replays a graph
    engine = Engine(model_path=model_path, dtype="float32", max_running_requests=8, **args)
    try:
        engine.tokenizer_manager.scheduler.decoder.draft_length = ScriptedDraftLength(3, walk)
        at_start = engine.get_internal_state()["graph_replays"]  # the start's profiles
        outs = engine.generate(PROMPTS[:12], [GREEDY] * 12)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outs] == [b["output_ids"] for b in baseline[:12]]
    replayed = {k for k, n in state["graph_replays"].items() if n > at_start.get(k, 0)}
    assert {"mtp_round_k1", "mtp_round_k2", "mtp_round_k3", "decode"} <= replayed, replayed
    assert not [kind for kind in replayed if kind.startswith("verify")], replayed
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == (state["max_total_num_tokens"])
    )


def test_per_request_plans_only_where_rows_cost(model_path, baseline):
    """The per-request adaptive policy prices a ragged verify by its rows; a batch whose
    rounds replay the whole-round graph verifies B(1 + K) rows whatever each request drafts,
    so its steps are planned one K for all (no ragged step), while batches the graph does
    not take (logprobs) are planned per request. Greedy tokens equal the baseline's."""
    args, _ = CONFIGS["walk-fia-graphs"]
    engine = Engine(model_path=model_path, dtype="float32", max_running_requests=8, **args)
    asked = []
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        policy = decoder.draft_length
        buckets = policy.costs.buckets
        costs = {(b, k): 1.0 + 0.1 * k for b in buckets for k in range(4)}  # drafts pay
        policy.costs = CostTable(buckets, 3, costs, {1: 0.01, 64: 0.64})
        plan = policy.plan

        def spy(estimates, count, per_request):
            asked.append(per_request)
            return plan(estimates, count, per_request)

        policy.plan = spy
        whole = engine.generate(PROMPTS[:8], [GREEDY] * 8)
        state = engine.get_internal_state()
        rounds = {asked.pop() for _ in range(len(asked))}
        logprobs = engine.generate(PROMPTS[:8], [GREEDY] * 8, return_logprob=True)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in whole] == [b["output_ids"] for b in baseline[:8]]
    assert_same_greedy("logprobs", logprobs, baseline[:8])
    assert rounds == {False} and state["spec_ragged_steps"] == 0
    assert sum(n for k, n in state["graph_replays"].items() if k.startswith("mtp_round")) > 0
    assert True in asked
