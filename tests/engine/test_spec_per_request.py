"""Per-request draft lengths (`sampling_params.speculative_num_steps`): lossless per request
whatever its neighbours ask.

Greedy, float32, shipped checkpoint: a batch whose requests ask 0, 1, 2, 3 drafts or leave it
to the server (K = 3) is token-identical, request by request, to eager decoding without
speculation (the session `baseline`), on both verify paths: expand's ragged rows (each request
verifies 1 + k_r rows) with graphs on and chunked prefill, eager with overlapped rounds and
per-request adaptive lengths (the MTP pass ragged too), and again with every request's 1 + K
rows and with the zeros run apart; the draft steps over the requests drafting further only
(serial steps); fia (1 + k_r query tokens per request in serial steps,
1 + K in overlapped rounds) with overlap and adaptive lengths; with logprobs, `n > 1` and a
grammar. Sampled: requests of mixed lengths follow the target distribution (the
chi-square check and stated power of test_spec_distribution: 800 samples detect a 0.058
shift between the two likeliest sequences with probability 0.9), and a biased rule served
the same way is rejected (the control)."""

from __future__ import annotations

import pytest
from lossless import GREEDY, PROMPTS, assert_same_greedy
from test_spec_distribution import ALPHA, PROMPT, SAMPLE, SAMPLES, _p_value, exact  # noqa: F401

from srt_ascend import Engine
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.speculative.acceptance import rejection_sample
from srt_ascend.speculative.mtp_worker import MTPWorker

K = 3
ASKED = [None, 0, 1, 2, 3]  # prompt i asks ASKED[i % 5]
SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": K, "dtype": "float32"}
CONFIGS = {
    "expand-graphs-chunked": {
        **SPEC,
        "speculative_verify": "expand",
        "enable_cpu_graph": True,
        "cuda_graph_bs": (1, 2, 4, 8),
        "chunked_prefill_size": 32,
    },
    "expand-eager-overlap-adaptive": {  # ragged MTP passes (eager), ragged overlapped rounds
        **SPEC,
        "speculative_verify": "expand",
        "enable_overlap_schedule": True,
        "speculative_adaptive": True,
    },
    "fia-overlap-adaptive": {
        **SPEC,
        "speculative_verify": "fia",
        "enable_overlap_schedule": True,
        "speculative_adaptive": True,
    },
}


def _params(i: int) -> dict:
    return {**GREEDY, "speculative_num_steps": ASKED[i % len(ASKED)]}


def _check_counts(outs: list[dict], adaptive: bool) -> None:
    """Each request drafted exactly the length it asked per step (the server's K, or at most
    it when adaptive, when it asked none), and accepted at most that; every decode step was
    counted (each emits its accepted drafts and one token more, the last step perhaps fewer)."""
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        steps, decoded = meta["spec_verify_ct"], meta["completion_tokens"] - 1
        assert steps <= decoded <= steps + meta["spec_accepted_tokens"], (i, meta)
        asked = ASKED[i % len(ASKED)]
        k_r = K if asked is None else asked
        drafted = meta["spec_draft_tokens"]
        if asked is None and adaptive:
            assert drafted <= K * meta["spec_verify_ct"], (i, meta)
        else:
            assert drafted == k_r * meta["spec_verify_ct"], (i, meta)
            assert meta["spec_draft_length"] == (k_r if meta["spec_verify_ct"] else 0.0)
        assert 0 <= meta["spec_accepted_tokens"] <= drafted


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_lengths_identical_to_mtp_off(model_path, baseline, name, monkeypatch):
    subsets = []  # (requests, batch) of the draft steps over the requests drafting further
    chain_step_of = MTPWorker._chain_step_of

    def spy(self, keep, j, reqs, *rest):
        subsets.append((len(keep), len(reqs)))
        return chain_step_of(self, keep, j, reqs, *rest)

    monkeypatch.setattr(MTPWorker, "_chain_step_of", spy)
    engine = Engine(model_path=model_path, **CONFIGS[name])
    try:
        params = [_params(i) for i in range(len(PROMPTS))]
        outs = engine.generate(PROMPTS, params, return_logprob=True)
        assert_same_greedy(name, outs, baseline)
        assert subsets and all(0 < a < b for a, b in subsets), subsets
        _check_counts(outs, CONFIGS[name].get("speculative_adaptive", False))
        assert sum(o["meta_info"]["spec_accepted_tokens"] for o in outs) > 0
        assert engine.get_internal_state()["spec_ragged_steps"] > 0  # 1 + k_r rows each
        if CONFIGS[name].get("enable_overlap_schedule"):  # lengths 1..3 only: rounds overlap
            before = engine.get_internal_state()
            idx = [i for i in range(len(PROMPTS)) if ASKED[i % len(ASKED)]][:12]
            some = engine.generate(
                [PROMPTS[i] for i in idx], [_params(i) for i in idx], return_logprob=True
            )
            assert_same_greedy(name, some, [baseline[i] for i in idx])
            after = engine.get_internal_state()
            assert after["num_overlapped_steps"] > before["num_overlapped_steps"]
            if name.startswith("expand"):  # lengths 1..3 in one round: ragged rows
                assert after["spec_ragged_steps"] > before["spec_ragged_steps"]
        if name == "expand-graphs-chunked":
            _unragged_paths(engine, baseline)
        # n > 1: both samples of a greedy request are the baseline's
        twice = engine.generate(PROMPTS[3], {**GREEDY, "n": 2, "speculative_num_steps": 2})
        assert [o["output_ids"] for o in twice] == [baseline[3]["output_ids"]] * 2
        # a grammar: asking 0, 2 or the server's K gives the same constrained output
        regex = {**GREEDY, "regex": r"[a-z_]+\((self|x)(, [a-z]+)*\)"}
        outs = engine.generate(
            [PROMPTS[7]] * 3, [{**regex, "speculative_num_steps": s} for s in (0, 2, None)]
        )
        assert all(o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in outs)
        assert outs[0]["output_ids"] == outs[1]["output_ids"] == outs[2]["output_ids"]
        state = engine.get_internal_state()
        assert (
            state["available_kv_tokens"] + state["cached_tokens_in_tree"]
            == state["max_total_num_tokens"]
        ), "KV slots leaked"
    finally:
        engine.shutdown()


def test_verify_graphs_without_ragged_rows_run_the_split(model_path, baseline):
    """A multi-query verify through a backend that reads the lengths on the device (the
    batch-invariant one here, as --enable-deterministic-inference chooses; the Triton one on
    CUDA) replays one row of 1 + K query tokens
    per request: its graphs hold no ragged batch (`GraphKind.holds_ragged`), which would run
    eagerly. Under graphs such a server plans no ragged verify: the zeros run apart as the
    plain step, the others verify 1 + K rows under their limits, and no verify runs eagerly.
    Greedy tokens equal the baseline's."""
    args = {
        **SPEC,
        "speculative_verify": "fia",
        "enable_deterministic_inference": True,
        "enable_cpu_graph": True,
        "cuda_graph_bs": (1, 2, 4, 8),
        "max_running_requests": 8,
        "context_length": 512,
    }
    engine = Engine(model_path=model_path, **args)
    eager = []
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        assert not decoder.ragged and decoder.split_zeros
        runner, forward_eager = decoder.runner, decoder.runner.forward_eager

        def spy(fb, *a, **kw):
            eager.append(fb.forward_mode)
            return forward_eager(fb, *a, **kw)

        runner.forward_eager = spy
        params = [_params(i) for i in range(8)]
        outs = engine.generate(PROMPTS[:8], params, return_logprob=True)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert_same_greedy("fia-device-lengths-graphs", outs, baseline[:8])
    _check_counts(outs, adaptive=False)
    assert state["spec_ragged_steps"] == 0
    assert ForwardMode.TARGET_VERIFY not in eager, eager
    assert any(n for k, n in state["graph_replays"].items() if k.startswith("verify"))


def _unragged_paths(engine, baseline) -> None:
    """The mixed batch above verified ragged rows (its zeros rode in the drafting steps, one
    row each); the same requests give the same tokens with every request's 1 + K rows, as
    under DP attention (zeros verify with limit 0: no plain step), and with the zeros run
    apart as the plain decoder's step (the split without a ragged verify)."""
    decoder = engine.tokenizer_manager.scheduler.decoder
    state = engine.get_internal_state()
    ragged = state["spec_ragged_steps"]
    assert ragged > 0
    steps = state["spec_draft_length_steps"]
    idx = [i for i in range(len(PROMPTS)) if ASKED[i % len(ASKED)] in (0, 1)][:8]
    prompts, params = [PROMPTS[i] for i in idx], [_params(i) for i in idx]
    decoder.ragged = False
    try:
        for split in (False, True):
            decoder.split_zeros = split
            some = engine.generate(prompts, params, return_logprob=True)
            assert_same_greedy(f"split={split}", some, [baseline[i] for i in idx])
            state = engine.get_internal_state()
            after = state["spec_draft_length_steps"]
            assert (after.get("0") != steps.get("0")) == split, (split, steps, after)
            steps = after
        assert state["spec_ragged_steps"] == ragged
    finally:
        decoder.ragged, decoder.split_zeros = True, False


def _mixed(seeded: bool) -> list[dict]:
    return [
        {
            **SAMPLE,
            "speculative_num_steps": ASKED[s % len(ASKED)],
            **({"seed": s} if seeded else {}),
        }
        for s in range(SAMPLES)
    ]


def _biased(tokens, draft_probs, target_probs, uniforms=None, generators=None, limits=None):
    """Broken on purpose: token-wise acceptance against the target sharpened to the power 1.5
    (a sampler at 2/3 of the asked temperature)."""
    sharp = target_probs.pow(1.5)
    sharp = sharp / sharp.sum(-1, keepdim=True)
    return rejection_sample(tokens, draft_probs, sharp, uniforms, generators, limits)


def test_mixed_lengths_follow_target_distribution(model_path, exact):  # noqa: F811
    engine = Engine(model_path=model_path, max_running_requests=64, **SPEC)
    try:
        seeded = engine.generate([PROMPT] * SAMPLES, _mixed(True))
        unseeded = engine.generate([PROMPT] * SAMPLES, _mixed(False))
        for name, outs in (("seeded", seeded), ("unseeded", unseeded)):
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
            p = _p_value(name, outs, exact)
            assert p > ALPHA, f"{name}: chi-square p = {p:.2e}"
        assert sum(o["meta_info"]["spec_accepted_tokens"] for o in seeded) > SAMPLES // 4
        # a seeded request's tokens do not depend on its neighbours' lengths
        alone = engine.generate(PROMPT, _mixed(True)[7])
        assert alone["output_ids"] == seeded[7]["output_ids"]
        engine.tokenizer_manager.scheduler.decoder.accept = _biased  # the control
        biased = engine.generate([PROMPT] * SAMPLES, _mixed(True))
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in biased)
        p = _p_value("biased", biased, exact)
        assert p < ALPHA, f"the biased rule passed: chi-square p = {p:.2e}"
    finally:
        engine.shutdown()
