"""Host time of an MTP round's seeded draws, serial rounds against overlapped rounds.

    python benchmark/seeded_draws.py [--batch 1 16] [--k 1 2 3] [--rounds 300] [--json-out FILE]

A seeded sampled request draws its uniforms from host generators keyed by its generated
count (`SamplingBatchInfo.from_params`, `mtp_worker.draft_seed_offset`). A serial round knows
the count: one generator per request for the verify's K+1 uniforms and one per draft step,
and K+1 candidates for the next d_1 (drawn before the read, picked by the accept length). An
overlapped round knows it as a range of K+1 counts (`mtp_worker.Counts`): K+1 candidates for
the verify and for each draft step, 2K+1 for the next d_1 (`stream_uniforms`), each count's
drawn once per request and kept (`stream_draws`: consecutive rounds' ranges overlap). This
times those host draws alone, over `--rounds` consecutive rounds whose accept lengths cycle
0..K (the functions the rounds call, on CPU tensors; no forwards, no probabilities):
median microseconds per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from srt_ascend.layers.sampler import draw_uniforms
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.speculative.mtp_worker import (
    Counts,
    counts_after,
    draft_seed_offset,
    stream_uniforms,
)

VOCAB = 1024


class Req:
    def __init__(self, seed: int) -> None:
        self.sampling_params = SamplingParams(temperature=0.8, seed=seed)
        self.sampling_params.normalize()
        self.decoder_state = None


def serial_round(reqs, generated: list[int], k: int, accept: torch.Tensor) -> None:
    params = [r.sampling_params for r in reqs]
    info = SamplingBatchInfo.from_params(params, VOCAB, "cpu", seed_offsets=generated)
    draw_uniforms(info.generators, k + 1, "cpu")  # the verify
    for j in range(1, k):  # draft steps 2..K
        offsets = [draft_seed_offset(g, j + 1) for g in generated]
        info = SamplingBatchInfo.from_params(params, VOCAB, "cpu", seed_offsets=offsets)
        draw_uniforms(info.generators, 1, "cpu")
    stream_uniforms(reqs, counts_after(generated, accept, k + 1), 1, 1)  # the next d_1


def overlapped_round(reqs, counts: Counts, k: int, accept: torch.Tensor) -> None:
    params = [r.sampling_params for r in reqs]
    SamplingBatchInfo.from_params(params, VOCAB, "cpu", generators=False)
    stream_uniforms(reqs, counts, 0, k + 1)  # the verify
    for j in range(1, k):
        SamplingBatchInfo.from_params(params, VOCAB, "cpu", generators=False)
        stream_uniforms(reqs, counts, j + 1, 1)
    stream_uniforms(reqs, counts_after(counts, accept, k + 1), 1, 1)


def per_round_us(b: int, k: int, rounds: int, overlapped: bool) -> float:
    """Median host time of `rounds` consecutive rounds over `b` fresh seeded requests."""
    reqs = [Req(seed=100 + i) for i in range(b)]
    generated, times = [40] * b, []
    for n in range(rounds):
        accept = torch.tensor([(n + i) % (k + 1) for i in range(b)])
        before = torch.tensor([(n - 1 + i) % (k + 1) for i in range(b)])  # the round before
        start = time.perf_counter()
        if overlapped:  # generated: the count before the round before
            overlapped_round(reqs, Counts([g + 1 for g in generated], before, k + 1), k, accept)
        else:
            serial_round(reqs, generated, k, accept)
        times.append(time.perf_counter() - start)
        generated = [g + int(a) + 1 for g, a in zip(generated, before)]
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--json-out")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'B':>3} {'K':>2} {'serial us':>10} {'overlapped us':>14} {'ratio':>6}")
    for b in args.batch:
        for k in args.k:
            serial = per_round_us(b, k, args.rounds, False)
            ahead = per_round_us(b, k, args.rounds, True)
            rows.append({"batch": b, "k": k, "serial_us": serial, "overlapped_us": ahead})
            print(f"{b:>3} {k:>2} {serial:>10.0f} {ahead:>14.0f} {ahead / serial:>6.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
