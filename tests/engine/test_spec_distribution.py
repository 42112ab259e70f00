"""Sampled outputs with MTP on follow the target distribution, through the served path.

A request samples 3 tokens at temperature 1 and top_k 3, so a sequence is one of at most 27
outcomes. Their exact probabilities come from the engine with speculation off (the top-3
logprobs after every prefix, renormalised: that is what top_k 3 samples from). With MTP on,
K = 1, 3 with token-wise acceptance and K = 3 with block verification, many requests
are sampled concurrently (seeded: one seed per request; unseeded: the global RNG) and the
emitted sequences are tested against the exact distribution with a
chi-square test at level ALPHA.

Power: at SAMPLES = 800 the test rejects with probability 0.9 a defect that moves
MIN_SHIFT = 0.058 of probability between the two likeliest sequences (the hardest place to see
a shift; 0.045 with probability 0.5; `test_stated_power_holds` checks this by simulation), and
much smaller shifts onto unlikely sequences. Finer defects are the unit tests' to catch
(tests/unit/test_acceptance.py, test_block_verify.py, test_draft_streams.py: shifts of 0.005).
The control (`test_control_a_biased_rule_is_caught`) serves a deliberately biased rule through
the same check, which must reject it.
"""

from __future__ import annotations

import math

import pytest
import torch

from srt_ascend import Engine
from srt_ascend.speculative.acceptance import block_verify

PROMPT = "def parse(self, text):\n    "
N_TOKENS, TOP_K, SAMPLES = 3, 3, 800
ALPHA = 1e-3
MIN_SHIFT = 0.058
SAMPLE = {"max_new_tokens": N_TOKENS, "temperature": 1.0, "top_k": TOP_K, "ignore_eos": True}


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's test; outcomes expected fewer than 5 times are pooled."""
    pairs = sorted(zip(expected, observed), reverse=True)
    obs, exp = [], []
    for e, o in pairs:
        if e >= 5 or not exp:
            exp.append(e)
            obs.append(o)
        else:
            exp[-1] += e
            obs[-1] += o
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def exact(model_path) -> dict[tuple[int, ...], float]:
    """P(sequence) under top_k 3 sampling, from MTP-off logprobs after each prefix."""
    engine = Engine(model_path=model_path, dtype="float32")
    try:
        prompt = engine.tokenizer_manager.tokenize(PROMPT)
        probs: dict[tuple[int, ...], float] = {(): 1.0}
        frontier = [()]
        for _ in range(N_TOKENS):
            outs = engine.generate(
                input_ids=[prompt + list(p) for p in frontier],
                sampling_params={"max_new_tokens": 1, "temperature": 0},
                return_logprob=True,
                top_logprobs_num=TOP_K,
            )
            nxt = []
            for p, out in zip(frontier, outs):
                top = out["meta_info"]["output_top_logprobs"][0]
                total = sum(math.exp(lp) for lp, *_ in top)
                for lp, tok, *_ in top:
                    probs[p + (tok,)] = probs[p] * math.exp(lp) / total
                    nxt.append(p + (tok,))
            frontier = nxt
        return {p: q for p, q in probs.items() if len(p) == N_TOKENS}
    finally:
        engine.shutdown()


def _sample(model_path, k: int, method: str, rule=None, **kw) -> tuple[list, list, dict]:
    """(seeded outputs, unseeded outputs, internal state) of SAMPLES requests each, with K
    drafts and `method`; `rule` replaces the acceptance rule (the controls); `kw`: more
    server arguments."""
    torch.manual_seed(1234 + k)  # the unseeded requests draw from the global RNG
    engine = Engine(
        model_path=model_path,
        dtype="float32",
        speculative_algorithm="MTP",
        speculative_num_steps=k,
        speculative_accept_method=method,
        **{"max_running_requests": 64, **kw},
    )
    try:
        if rule is not None:
            engine.tokenizer_manager.scheduler.decoder.accept = rule
        seeds = [{**SAMPLE, "seed": s} for s in range(SAMPLES)]
        seeded = engine.generate([PROMPT] * SAMPLES, seeds)
        unseeded = engine.generate([PROMPT] * SAMPLES, SAMPLE)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    return seeded, unseeded, state


def _p_value(name: str, outs: list, exact: dict) -> float:
    outcomes = sorted(exact)
    counts = dict.fromkeys(outcomes, 0)
    for o in outs:
        seq = tuple(o["output_ids"])
        assert seq in counts, f"{name}: {seq} is outside the top-{TOP_K} support"
        counts[seq] += 1
    return _chi_square_p([counts[s] for s in outcomes], [exact[s] * SAMPLES for s in outcomes])


# K = 1 and 3 token-wise, block verification at K = 3 (the control serves it at K = 2); K = 2
# token-wise and block at K = 2 are the unit tests' (test_acceptance, test_block_verify)
@pytest.mark.parametrize(("k", "method"), [(1, "token"), (3, "token"), (3, "block")])
def test_mtp_sampling_follows_target_distribution(model_path, exact, k, method):
    seeded, unseeded, state = _sample(model_path, k, method)
    assert state["avg_spec_accept_length"] > 1.2, "too few drafts accepted to test anything"
    for name, outs in (("seeded", seeded), ("unseeded", unseeded)):
        p = _p_value(name, outs, exact)
        assert p > ALPHA, f"K={k} {method} {name}: chi-square p = {p:.2e}"


# the whole-round graph's sampled variant (CPU: an eager replay of the captured body)
ROUND_GRAPH = {
    "enable_cpu_graph": True,
    "cuda_graph_bs": (4, 16),
    "max_running_requests": 16,
    "disable_overlap_schedule": True,
}


def test_round_graph_sampling_follows_target_distribution(model_path, exact):
    """K = 2 token-wise through the round graph's sampled variant (every round of the batch
    replays `mtp_round_sampled_k2`, no per-forward verify): the emitted sequences follow the
    target distribution; the same rule biased (`_sharpened_block_verify`, which the round
    reads at each replay here) is rejected."""
    seeded, unseeded, state = _sample(model_path, 2, "token", **ROUND_GRAPH)
    replays = state["graph_replays"]
    assert replays.get("mtp_round_sampled_k2", 0) > 0, replays
    assert not replays.get("verify_fia") and not replays.get("verify_expand"), replays
    for name, outs in (("seeded", seeded), ("unseeded", unseeded)):
        p = _p_value(name, outs, exact)
        assert p > ALPHA, f"round graph {name}: chi-square p = {p:.2e}"
    biased, _, _ = _sample(model_path, 2, "block", _sharpened_block_verify, **ROUND_GRAPH)
    p = _p_value("biased", biased, exact)
    assert p < ALPHA, f"the biased rule passed the round graph: chi-square p = {p:.2e}"


def _sharpened_block_verify(
    tokens, draft_probs, target_probs, uniforms=None, generators=None, limits=None
):
    """Broken on purpose: block verification against the target raised to the power 1.5 and
    renormalised (a sampler whose temperature is 2/3 of the one asked for)."""
    sharp = target_probs.pow(1.5)
    return block_verify(
        tokens, draft_probs, sharp / sharp.sum(-1, keepdim=True), uniforms, generators, limits
    )


def test_control_a_biased_rule_is_caught(model_path, exact):
    """The served check, run on a biased rule (`_sharpened_block_verify`), rejects it."""
    seeded, unseeded, _ = _sample(model_path, 2, "block", _sharpened_block_verify)
    for name, outs in (("seeded", seeded), ("unseeded", unseeded)):
        p = _p_value(name, outs, exact)
        assert p < ALPHA, f"the biased rule passed ({name}): chi-square p = {p:.2e}"


def test_stated_power_holds(exact):
    """Multinomial samples of SAMPLES sequences with MIN_SHIFT moved from the likeliest
    sequence to the second are rejected at least 80% of the time (0.9 expected), exact
    ones at most 2% (0.1% expected)."""
    outcomes = sorted(exact)
    expected = torch.tensor([exact[s] for s in outcomes], dtype=torch.float64)
    first, second = expected.argsort(descending=True)[:2].tolist()
    shifted = expected.clone()
    shifted[first] -= MIN_SHIFT
    shifted[second] += MIN_SHIFT
    g = torch.Generator().manual_seed(0)
    rates = []
    for probs in (shifted, expected):
        draws = torch.multinomial(probs, SAMPLES * 200, replacement=True, generator=g)
        rejected = 0
        for trial in draws.view(200, SAMPLES):
            counts = torch.bincount(trial, minlength=len(outcomes)).tolist()
            rejected += _chi_square_p(counts, (expected * SAMPLES).tolist()) < ALPHA
        rates.append(rejected / 200)
    assert rates[0] >= 0.8 and rates[1] <= 0.02, rates
