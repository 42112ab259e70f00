"""Sampled outputs with MTP on follow the target distribution, through the served path.

A request samples 3 tokens at temperature 1 and top_k 3, so a sequence is one of at most 27
outcomes. Their exact probabilities come from the engine with speculation off (the top-3
logprobs after every prefix, renormalised: that is what top_k 3 samples from). With MTP on,
K = 1, 2, 3 with token-wise acceptance and K = 2, 3 with block verification, many requests
are sampled concurrently (seeded: one seed per request; unseeded: the global RNG) and the
emitted sequences are tested against the exact distribution with a
chi-square test. Reusing one uniform for several drafts, or dropping a draw, shows up here:
each step's emitted tokens depend on several draft and acceptance draws at once.
"""

from __future__ import annotations

import math

import pytest
import torch

from srt_ascend import Engine

PROMPT = "def parse(self, text):\n    "
N_TOKENS, TOP_K, SAMPLES = 3, 3, 240
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


@pytest.mark.parametrize(
    ("k", "method"), [(1, "token"), (2, "token"), (3, "token"), (2, "block"), (3, "block")]
)
def test_mtp_sampling_follows_target_distribution(model_path, exact, k, method):
    torch.manual_seed(1234 + k)  # the unseeded requests draw from the global RNG
    engine = Engine(
        model_path=model_path,
        dtype="float32",
        speculative_algorithm="MTP",
        speculative_num_steps=k,
        speculative_accept_method=method,
        max_running_requests=64,
    )
    try:
        seeds = [{**SAMPLE, "seed": s} for s in range(SAMPLES)]
        seeded = engine.generate([PROMPT] * SAMPLES, seeds)
        unseeded = engine.generate([PROMPT] * SAMPLES, SAMPLE)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert state["avg_spec_accept_length"] > 1.2, "too few drafts accepted to test anything"
    outcomes = sorted(exact)
    for name, outs in (("seeded", seeded), ("unseeded", unseeded)):
        counts = dict.fromkeys(outcomes, 0)
        for o in outs:
            seq = tuple(o["output_ids"])
            assert seq in counts, f"{name}: {seq} is outside the top-{TOP_K} support"
            counts[seq] += 1
        p = _chi_square_p([counts[s] for s in outcomes], [exact[s] * SAMPLES for s in outcomes])
        assert p > 1e-3, f"K={k} {method} {name}: chi-square p = {p:.2e}"
