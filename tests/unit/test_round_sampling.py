"""The sampled MTP round graph's sampling (speculative/round_sampling): the distributions it
computes with the per-forward path's batch-wide branches as device selections are bit-equal to
`processed_probs` for the same batch, and the uniforms its host block carries are the numbers
the per-forward path draws for seeded rows, at every count of an overlapped round's range."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.sampler import processed_probs
from srt_ascend.sampling import static_sampling
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.speculative import round_sampling as rs
from srt_ascend.speculative.mtp_worker import Counts, counts_after, stream_uniforms

VOCAB = 300
SETTINGS = {
    "temperature": {"temperature": 0.8, "seed": 11},
    "top_k": {"temperature": 1.0, "top_k": 20, "seed": 12},
    "top_p": {"temperature": 0.7, "top_p": 0.9},
    "greedy": {"temperature": 0.0},
    "min_p": {"temperature": 1.2, "min_p": 0.05, "seed": 14},
}


class Req:
    def __init__(self, **kw) -> None:
        self.sampling_params = SamplingParams(**kw)
        self.sampling_params.normalize()
        self.decoder_state = None


def reqs_of(names) -> list[Req]:
    return [Req(**SETTINGS[n]) for n in names]


@pytest.mark.parametrize(
    "names",
    [
        list(SETTINGS),
        ["temperature"],
        ["temperature", "min_p"],  # renormalised, not pinned
        ["temperature", "top_p"],
        ["temperature", "greedy"],  # a greedy row pins the batch
    ],
)
def test_static_probs_bit_equal_processed_probs(names):
    reqs = reqs_of(names)
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    info = SamplingBatchInfo.from_params([r.sampling_params for r in reqs], VOCAB, "cpu")
    block = rs.host_block(reqs, [0] * len(reqs), 1, 2, 3, 8, VOCAB)
    filtered = static_sampling.needs_filter(reqs, VOCAB)  # the graph variant it replays
    assert filtered == info.need_top_p_top_k
    settings = rs.RowSettings(block, torch.zeros(len(reqs), dtype=torch.int64), 2, 3, filtered)
    assert torch.equal(settings.probs(logits), processed_probs(logits, info))


@pytest.mark.parametrize("k, span", [(1, 1), (3, 1), (2, 3), (3, 4)])
def test_block_uniforms_are_the_streams(k, span):
    """Seeded sampled rows: draft step j's, the verify's and the next d_1's uniforms (picked
    at the count past the lowest and the accept length) equal `stream_uniforms`'."""
    names = ["temperature", "top_k", "min_p", "greedy", "top_p"]
    reqs = reqs_of(names)
    seeded = [i for i, n in enumerate(names) if n in ("temperature", "top_k", "min_p")]
    low = [5, 9, 0, 3, 2]
    extra = torch.tensor([span - 1, 0, span // 2, 0, 0])
    accept = torch.tensor([k, 0, 1 % (k + 1), 0, 0])
    block = rs.host_block(reqs, low, span, k, 3, 8, VOCAB)
    s = rs.RowSettings(block, extra, k, 3, True)
    counts = Counts(low, extra, span)
    for j in range(1, k):
        want = stream_uniforms(reqs, counts, j + 1, 1)[:, 0]
        assert torch.equal(s.u_chain[seeded, j - 1], want[seeded])
    assert torch.equal(s.u_verify[seeded], stream_uniforms(reqs, counts, 0, k + 1)[seeded])
    after = counts_after(counts, accept, k + 1)
    want = stream_uniforms(reqs, after, 1, 1)[:, 0]
    assert torch.equal(s.u_next(accept)[seeded], want[seeded])
    assert ((s.u_verify > 0) & (s.u_verify <= 1)).all()
    assert block[5:].eq(rs.padding_rows(3, 3)).all()  # padding rows
