from __future__ import annotations

import math

import pytest
import torch

from srt_ascend.layers import sampler as sampler_module
from srt_ascend.layers.sampler import (
    Sampler,
    draw_uniforms,
    inverse_cdf_sample,
    processed_probs,
    sample_from_probs,
    token_logprobs,
)
from srt_ascend.sampling import SamplingBatchInfo, SamplingParams, mix_seed
from srt_ascend.utils import HOST_READS

V = 64


def _reference_keep(logits: torch.Tensor, p: SamplingParams) -> list[bool]:
    """Per-row reference of the top-k / top-p / min-p rule in float64 Python."""
    if p.is_greedy:
        best = max(range(len(logits)), key=lambda v: (logits[v].item(), -v))
        return [v == best for v in range(len(logits))]
    probs = torch.softmax(logits.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda v: (-probs[v], v))
    top_k = len(probs) if p.top_k == -1 else p.top_k
    keep = [False] * len(probs)
    mass_above = 0.0
    for rank, v in enumerate(order):
        in_top_p = p.top_p >= 1.0 or mass_above < p.top_p
        keep[v] = rank < top_k and in_top_p and probs[v] >= p.min_p * probs[order[0]]
        mass_above += probs[v]
    return keep


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.4),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(top_k=1),
        SamplingParams(top_k=V + 10, top_p=0.95),
        SamplingParams(temperature=2.0, top_p=0.123),
        SamplingParams(top_k=3, seed=11),
    ]


def test_processed_probs_masks_match_per_row_reference() -> None:
    torch.manual_seed(0)
    params = _mixed_params()
    logits = torch.randn(len(params), V) * 3
    info = SamplingBatchInfo.from_params(params, V, "cpu")
    probs = processed_probs(logits, info)
    assert torch.allclose(probs.sum(-1), torch.ones(len(params)))
    for row, p in enumerate(params):
        keep = torch.tensor(_reference_keep(logits[row], p))
        assert torch.equal(probs[row] > 0, keep), f"row {row}: {p}"
        base = torch.softmax(logits[row].double() / (1.0 if p.is_greedy else p.temperature), -1)
        expected = torch.where(keep, base, 0.0)
        torch.testing.assert_close(
            probs[row].double(), expected / expected.sum(), atol=1e-6, rtol=0
        )


def test_processed_probs_ties_and_unnormalized_params() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    normalized = SamplingBatchInfo.from_params([SamplingParams(top_k=2).normalize()], 5, "cpu")
    raw = SamplingBatchInfo.from_params([SamplingParams(top_k=2)], 5, "cpu")
    probs = processed_probs(logits, normalized)
    assert torch.equal(probs, processed_probs(logits, raw))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]]))
    greedy = SamplingBatchInfo.from_params([SamplingParams(temperature=0)], 5, "cpu")
    assert torch.equal(processed_probs(logits, greedy), torch.tensor([[0.0, 1, 0, 0, 0]]))


def test_greedy_rows_agree_between_all_greedy_and_mixed_batches() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    greedy = SamplingParams(temperature=0.0)
    all_greedy = SamplingBatchInfo.from_params([greedy] * 4, V, "cpu")
    mixed = SamplingBatchInfo.from_params([greedy, SamplingParams(), greedy, greedy], V, "cpu")
    assert all_greedy.is_all_greedy and not mixed.is_all_greedy
    a = processed_probs(logits, all_greedy)
    b = processed_probs(logits, mixed)
    assert torch.equal(a[[0, 2, 3]], b[[0, 2, 3]])
    out = Sampler()(logits, mixed)
    assert torch.equal(out.next_token_ids[[0, 2, 3]], logits.argmax(-1)[[0, 2, 3]])


def test_batch_info_fields_flags_and_row_selection() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_p=0.9, seed=3)]
    info = SamplingBatchInfo.from_params(params, V, "cpu")
    assert info.temperatures.shape == (2, 1)
    assert info.top_ks.tolist() == [1, V] and info.temperatures.view(-1).tolist() == [1.0, 0.5]
    assert info.need_top_p_top_k and not info.need_min_p and not info.need_penalties
    assert info.generators[0] is None and info.generators[1] is not None
    plain = SamplingBatchInfo.from_params([SamplingParams()], V, "cpu")
    assert not (plain.is_all_greedy or plain.need_top_p_top_k or plain.need_min_p)

    expanded = info.repeat_interleave(3)
    assert expanded.batch_size == 6 and expanded.top_ks.tolist() == [1, 1, 1, V, V, V]
    assert expanded.generators[3] is info.generators[1] and expanded.generators[0] is None
    ragged = info.repeat_interleave([1, 2])
    assert ragged.top_ps.tolist() == pytest.approx([1.0, 0.9, 0.9])
    picked = expanded.index(torch.tensor([5, 0]))
    assert picked.top_ks.tolist() == [V, 1] and picked.generators[0] is info.generators[1]
    assert picked.temperatures.shape == (2, 1)


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    torch.manual_seed(2)
    target_logits = torch.randn(V)
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)

    def tokens_in_batch(neighbours: int, where: int, offset: int) -> int:
        params = [SamplingParams(temperature=0.9) for _ in range(neighbours)]
        params.insert(where, seeded)
        logits = torch.randn(len(params), V)
        logits[where] = target_logits
        offsets = [offset if i == where else 17 for i in range(len(params))]
        info = SamplingBatchInfo.from_params(params, V, "cpu", seed_offsets=offsets)
        return int(Sampler()(logits, info).next_token_ids[where])

    for offset in range(5):
        alone = tokens_in_batch(0, 0, offset)
        assert tokens_in_batch(5, 3, offset) == alone
        assert tokens_in_batch(9, 9, offset) == alone
    streams = {tuple(draw_uniforms(_gens(1234, off), 4, "cpu")[0].tolist()) for off in range(6)}
    assert len(streams) == 6
    assert mix_seed(1234, 3) == mix_seed(1234, 3) != mix_seed(1235, 3)


def _gens(seed: int, offset: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(mix_seed(seed, offset))]


def test_inverse_cdf_sampling_matches_probs_and_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.4, 0.2, 0.3, 0.0])
    n = 20000
    g = torch.Generator().manual_seed(0)
    u = 1.0 - torch.rand(n, generator=g)
    tokens = inverse_cdf_sample(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    nz = probs > 0
    chi2 = (((counts - expected) ** 2)[nz] / expected[nz]).sum().item()
    assert chi2 < 16.266  # chi-square 0.999 quantile, 3 dof
    edges = inverse_cdf_sample(probs.expand(3, -1), torch.tensor([1e-12, 1.0, 0.1]))
    assert edges.tolist() == [1, 5, 1]


def test_sample_from_probs_greedy_and_one_hot_rows() -> None:
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.0, 0.0, 1.0]])
    greedy = SamplingBatchInfo.from_params([SamplingParams(temperature=0)] * 2, 3, "cpu")
    assert sample_from_probs(probs, greedy).tolist() == [1, 2]
    mixed = SamplingBatchInfo.from_params(
        [SamplingParams(temperature=0), SamplingParams()], 3, "cpu"
    )
    for _ in range(20):
        assert sample_from_probs(probs, mixed).tolist() == [1, 2]


def test_sampler_logprobs_are_log_softmax_over_the_temperature(monkeypatch) -> None:
    """SGLang's sampler: log_softmax(logits / T) (T = 1 for a greedy row), before top-k /
    top-p; with SGLANG_RETURN_ORIGINAL_LOGPROB the logits as given."""
    torch.manual_seed(3)
    logits = torch.randn(4, V).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.3),
        SamplingParams(top_k=4),
        SamplingParams(),
        SamplingParams(temperature=0.0),
    ]
    info = SamplingBatchInfo.from_params([p.normalize() for p in params], V, "cpu")
    before = logits.clone()
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[2, 0, 5, 1])
    assert torch.equal(logits, before)
    temps = torch.tensor([[0.3], [1.0], [1.0], [1.0]])
    ref = torch.log_softmax(logits.float() / temps, dim=-1)
    assert out.logprobs.top[3][0][1] == int(logits[3].float().argmax())
    monkeypatch.setattr(sampler_module, "RETURN_ORIGINAL_LOGPROB", True)
    original = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[1, 0, 0, 0])
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert math.isclose(original.logprobs.top[0][0][0], float(raw[0].max()), rel_tol=1e-6)
    expected = ref.gather(-1, out.next_token_ids.view(-1, 1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs.chosen), expected)
    assert out.logprobs.top[1] == []
    values, ids = zip(*out.logprobs.top[2])
    assert len(ids) == 5
    torch.testing.assert_close(torch.tensor(values), ref[2].sort(descending=True).values[:5])
    for value, token in out.logprobs.top[0]:
        assert math.isclose(value, float(ref[0][token]), rel_tol=1e-6)
    quiet = Sampler()(logits, info)
    assert quiet.logprobs is None


def test_token_logprobs_is_log_softmax_with_tops_clamped_to_the_vocabulary() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, V)
    ids = torch.randint(0, V, (5,))
    ref = torch.log_softmax(logits, dim=-1)
    out = token_logprobs(logits, ids, [3, 0, V + 7, 1, 3])
    chosen, tops = out.chosen, out.top
    torch.testing.assert_close(torch.tensor(chosen), ref[torch.arange(5), ids])
    assert [len(t) for t in tops] == [3, 0, V, 1, 3]
    for row, top in enumerate(tops):
        values = [v for v, _ in top]
        assert values == sorted(values, reverse=True)
        for value, token in top:
            assert math.isclose(value, float(ref[row, token]), rel_tol=1e-6)
    assert [t[0][1] for t in (tops[0], tops[3])] == logits[[0, 3]].argmax(-1).tolist()
    assert out.ids == [[]] * 5


def test_token_logprobs_reports_asked_ids_in_order_in_one_read(monkeypatch) -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    ref = torch.log_softmax(logits, dim=-1)
    asked = [[4, 0, 4], [], [V - 1]]
    reads = []
    monkeypatch.setattr(HOST_READS, "read", lambda t: reads.append(t) or t.tolist())
    out = token_logprobs(logits, logits.argmax(-1), [2, 0, 0], asked)
    assert len(reads) == 1
    assert [len(x) for x in out.ids] == [3, 0, 1]
    for row, ids in enumerate(asked):
        torch.testing.assert_close(
            torch.tensor(out.ids[row], dtype=torch.float64), ref[row, ids].double()
        )
    assert out.rows(1, 3).ids == out.ids[1:] and out.rows(0, 1).chosen == out.chosen[:1]
    assert math.isclose(float(ref[0].exp().sum()), 1.0, rel_tol=1e-5)


def test_top_p_below_float32_range_keeps_the_top_token() -> None:
    """A top_p in (0, 1] that float32 rounds to 0 (1e-46) still keeps the most likely token
    (SGLang's rule: a token is dropped only when the mass above it exceeds top_p); the row
    used to lose every token and sample from NaNs."""
    torch.manual_seed(6)
    logits = torch.randn(2, V) * 3
    params = [SamplingParams(top_p=1e-46, seed=1), SamplingParams(top_p=1e-46)]
    info = SamplingBatchInfo.from_params(params, V, "cpu")
    probs = processed_probs(logits, info)
    expected = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    torch.testing.assert_close(probs, expected)
    assert sample_from_probs(probs, info).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bias,temperature", [(3.5e38, 1.0), (1e38, 0.01), (3.5e38, 0.0)])
def test_a_bias_past_float32_range_forces_its_token(bias, temperature) -> None:
    """A logit_bias whose biased (or temperature-scaled) logit overflows float32 to +inf
    forces its token, with finite logprobs: softmax over +inf used to give NaNs (a garbage
    token, null logprobs)."""
    from srt_ascend.sampling.penalties import apply_logit_bias

    torch.manual_seed(7)
    logits = apply_logit_bias(torch.randn(1, V), [0], [{5: bias}])
    params = SamplingParams(temperature=temperature, seed=2).normalize()
    info = SamplingBatchInfo.from_params([params], V, "cpu")
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[2])
    assert out.next_token_ids.tolist() == [5]
    assert out.logprobs.chosen == [0.0]
    assert out.logprobs.top[0][0] == (0.0, 5)
    assert all(math.isfinite(v) for v, _ in out.logprobs.top[0])


def test_a_masked_token_logprob_is_float32_lowest_not_minus_inf() -> None:
    """SGLang clamps reported logprobs at float32's lowest value: a masked token (-inf, e.g.
    EOS under min_new_tokens) asked by token_ids_logprob is a number, not JSON's null."""
    logits = torch.randn(1, V)
    logits[0, 3] = -math.inf
    out = token_logprobs(logits, torch.tensor([0]), [V], [[3, 0]])
    assert out.ids[0][0] == torch.finfo(torch.float32).min
    assert out.top[0][-1] == (torch.finfo(torch.float32).min, 3)


def test_a_temperature_past_float32_range_samples_the_unmasked_tokens_uniformly() -> None:
    """A temperature that float32 makes +inf (1e39) is held at float32's largest value: the
    distribution is uniform over the tokens left unmasked (-inf / inf was NaN, and a NaN row
    sampled a masked token)."""
    logits = torch.randn(1, V) * 3
    logits[0, 10:] = -math.inf  # e.g. a grammar's mask
    params = SamplingParams(temperature=1e39, seed=4).normalize()
    info = SamplingBatchInfo.from_params([params], V, "cpu")
    probs = processed_probs(logits, info)
    torch.testing.assert_close(probs[0, :10], torch.full((10,), 0.1))
    assert probs[0, 10:].sum() == 0
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_nums=[1])
    assert out.next_token_ids.item() < 10
    assert out.logprobs.chosen[0] == pytest.approx(-math.log(10))
