"""Incremental penalty statistics (sampling.penalty_state) give exactly the penalised logits
that rebuilding the counts from every request's full token lists gave (the reference below is
that code, as it was), at plain decode positions, at every verify position and at every draft
step of an MTP step, while requests commit tokens, leave and rejoin the batch and join late;
and after its first step a request's statistics cost a copy of only its new tokens."""

from __future__ import annotations

import sys

import torch

from srt_ascend.sampling.penalties import apply_penalties
from srt_ascend.sampling.sample_step import penalised_logits, verify_logits
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.utils import to_device

V = 64
EOS = 1
K = 3


class _Req:
    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.sampling_params = params.normalize()
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.token_ids_logprob = None
        self.grammar = None
        self.penalty_state = None


def reference(logits, reqs, info, extra=None):
    """The penalties as computed before: [B, V] counts and prompt mask rebuilt from every
    prompt and output id (and the drafts in `extra`) at each call."""
    counts = torch.zeros(len(reqs), V, dtype=torch.int64)
    prompt = torch.zeros(len(reqs), V, dtype=torch.bool)
    out_rows = [i for i, r in enumerate(reqs) for _ in r.output_ids]
    out_ids = [t for r in reqs for t in r.output_ids]
    if out_ids:
        index = to_device([out_rows, out_ids], "cpu")
        counts.index_put_((index[0], index[1]), torch.ones_like(index[0]), accumulate=True)
    if extra is not None and extra.shape[1]:
        counts.scatter_add_(1, extra, torch.ones_like(extra))
    in_rows = [i for i, r in enumerate(reqs) for _ in r.origin_input_ids]
    index = to_device([in_rows, [t for r in reqs for t in r.origin_input_ids]], "cpu")
    prompt[index[0], index[1]] = True
    return apply_penalties(logits, info, counts, prompt)


PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(),  # no penalties, in a batch with some
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
    SamplingParams(presence_penalty=2.0),  # joins late
]


def test_incremental_equals_rebuilt_at_decode_verify_and_draft_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    reqs = [
        _Req(p, torch.randint(2, V, (int(n),), generator=gen).tolist())
        for p, n in zip(PARAMS, torch.randint(1, 30, (len(PARAMS),), generator=gen))
    ]
    checked = 0
    for step in range(12):
        # request 4 joins at step 5; request 1 sits out steps 3-4 (retracted, then back)
        batch = [
            r
            for i, r in enumerate(reqs)
            if (i != 4 or step >= 5) and (i != 1 or step not in (3, 4))
        ]
        info = SamplingBatchInfo.from_params([r.sampling_params for r in batch], V, "cpu")
        logits = torch.randn(len(batch), K + 1, V, generator=gen) * 3
        drafts = torch.randint(0, V, (len(batch), K), generator=gen)
        if step % 2 == 0:  # a plain decode position
            got = penalised_logits(logits[:, 0], batch, info, [EOS])
            assert torch.equal(got, reference(logits[:, 0], batch, info))
        else:  # an MTP step: the draft chain, then verify
            for j in range(K):
                got = penalised_logits(logits[:, j], batch, info, [EOS], drafts[:, :j])
                assert torch.equal(got, reference(logits[:, j], batch, info, drafts[:, :j]))
            got = verify_logits(logits, batch, info, [EOS], drafts)
            for j in range(K + 1):
                want = reference(logits[:, j], batch, info, drafts[:, :j])
                assert torch.equal(got[:, j], want)
        checked += 1
        for r in batch:  # commit 1..K+1 tokens, repeats likely (V is small)
            n = int(torch.randint(1, K + 2, (1,), generator=gen))
            r.output_ids += torch.randint(0, V, (n,), generator=gen).tolist()
    assert checked == 12
    assert all(r.penalty_state is not None for i, r in enumerate(reqs) if i != 2)
    assert reqs[2].penalty_state is None  # no penalties: no statistics kept


def test_a_step_copies_only_the_new_tokens(monkeypatch) -> None:
    copied: list[int] = []

    def counting(data, device, dtype=torch.int64):
        if not isinstance(data, torch.Tensor):
            copied.append(torch.tensor(data).numel())
        return to_device(data, device, dtype)

    for name, module in list(sys.modules.items()):
        if name.startswith("srt_ascend.sampling") and hasattr(module, "to_device"):
            monkeypatch.setattr(module, "to_device", counting)
    reqs = [_Req(SamplingParams(frequency_penalty=0.5), list(range(2, 60)) * 4) for _ in range(2)]
    for r in reqs:
        r.output_ids = list(range(2, 50))
    info = SamplingBatchInfo.from_params([r.sampling_params for r in reqs], V, "cpu")
    logits = torch.randn(2, V)
    penalised_logits(logits, reqs, info, [EOS])  # first step: the prompts and outputs once
    for _ in range(5):
        for r in reqs:
            r.output_ids += [7, 8]
        copied.clear()
        got = penalised_logits(logits, reqs, info, [EOS])
        assert sum(copied) <= 2 * 2 * 2  # [rows; ids] of 2 new tokens per request
        assert torch.equal(got, reference(logits, reqs, info))
