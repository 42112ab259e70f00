from __future__ import annotations

import torch

from srt_ascend.sampling import SamplingBatchInfo, SamplingParams
from srt_ascend.sampling.penalties import apply_penalties, mask_stop_tokens

V = 32


def _reference(logits, params, counts, prompt_mask):
    out = logits.clone().double()
    for b, p in enumerate(params):
        for v in range(out.shape[1]):
            count = int(counts[b, v])
            x = float(out[b, v])
            if bool(prompt_mask[b, v]) or count > 0:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (1.0 if count > 0 else 0.0)
            out[b, v] = x
    return out


def test_penalties_match_loop_reference() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=1.1),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=-2.0),
    ]
    logits = torch.randn(len(params), V) * 4
    counts = torch.randint(0, 3, (len(params), V)) * (torch.rand(len(params), V) < 0.3)
    prompt_mask = torch.rand(len(params), V) < 0.2
    info = SamplingBatchInfo.from_params(params, V, "cpu")
    assert info.need_penalties
    before = logits.clone()
    out = apply_penalties(logits, info, counts, prompt_mask)
    assert torch.equal(logits, before)
    torch.testing.assert_close(out.double(), _reference(logits, params, counts, prompt_mask))
    assert torch.equal(out[0], logits[0])


def test_neutral_batch_is_a_copy() -> None:
    logits = torch.randn(2, V)
    info = SamplingBatchInfo.from_params([SamplingParams()] * 2, V, "cpu")
    assert not info.need_penalties
    counts = torch.ones(2, V, dtype=torch.int64)
    out = apply_penalties(logits, info, counts, torch.ones(2, V, dtype=torch.bool))
    assert torch.equal(out, logits) and out.data_ptr() != logits.data_ptr()


def test_penalties_follow_rows_of_a_verify_batch() -> None:
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0)]
    info = SamplingBatchInfo.from_params(params, V, "cpu").repeat_interleave(2)
    logits = torch.zeros(4, V)
    counts = torch.zeros(4, V, dtype=torch.int64)
    counts[:, 5] = 1
    out = apply_penalties(logits, info, counts, torch.zeros(4, V, dtype=torch.bool))
    assert out[:, 5].tolist() == [0.0, 0.0, -1.0, -1.0]


def test_mask_stop_tokens_shared_and_per_row() -> None:
    logits = torch.zeros(3, V)
    shared = mask_stop_tokens(logits, [0, 2], [1, 7])
    assert torch.isinf(shared[[0, 0, 2, 2], [1, 7, 1, 7]]).all()
    assert torch.isfinite(shared[1]).all() and int(torch.isinf(shared).sum()) == 4
    assert torch.isfinite(logits).all()
    per_row = mask_stop_tokens(logits, torch.tensor([1, 2]), [[4], [5, 6]])
    assert torch.isinf(per_row[[1, 2, 2], [4, 5, 6]]).all() and int(torch.isinf(per_row).sum()) == 3
    assert torch.equal(mask_stop_tokens(logits, [], [1]), logits)


def test_logit_bias_adds_to_the_rows_tokens() -> None:
    from srt_ascend.sampling.penalties import apply_logit_bias

    logits = torch.randn(3, V)
    out = apply_logit_bias(logits, [0, 2], [{4: 100.0, 7: -2.5}, {4: -100.0}])
    want = logits.clone()
    want[0, 4] += 100.0
    want[0, 7] -= 2.5
    want[2, 4] -= 100.0
    assert torch.equal(out, want)
    assert torch.equal(apply_logit_bias(logits, [], []), logits)


def test_a_tiny_repetition_penalty_keeps_the_seen_tokens_in_order() -> None:
    """repetition_penalty in (0, 2]: near 0 (1e-46 is 0 in float32; 1e-38 overflows a logit of
    4) the seen positive logits stay finite and in their order, so the largest wins; they all
    became +inf, a tie the first index won."""
    logits = torch.zeros(2, V)
    logits[:, 3], logits[:, 7] = 4.0, 9.0
    seen = torch.zeros(2, V, dtype=torch.bool)
    seen[:, [3, 7]] = True
    params = [SamplingParams(repetition_penalty=1e-46), SamplingParams(repetition_penalty=1e-38)]
    info = SamplingBatchInfo.from_params(params, V, "cpu")
    out = apply_penalties(logits, info, torch.zeros(2, V, dtype=torch.int64), seen)
    assert torch.isfinite(out).all()
    assert out.argmax(-1).tolist() == [7, 7]
    assert (out[:, 7] > out[:, 3]).all() and (out[:, 3] > 0).all()
