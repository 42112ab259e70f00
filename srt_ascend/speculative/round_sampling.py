"""Sampling inside a captured MTP round (issue 43 item 3, the sampled half).

A round graph's sampled variant draws its drafts, runs the lossless acceptance rule and draws
the next d_1 on the device, from one static float32 block of per-row inputs the host fills
before the replay (one packed copy, `host_block`):

    settings (sampling/static_sampling) | U_chain | U_verify | U_next

the uniforms in (0, 1], `1 - rand` as `draw_uniforms` / `uniforms_among` make them, for
  every count the row may have (one in a serial round; an overlapped round's range,
  `Counts`, picked on the device at `extra`): draft step j's (seeded: the stream
  `draft_seed_offset(count, j+1)`), the verify's U_1..U_{K+1} (seeded: the stream of the
  count), and the next d_1's, one per count the round may leave (seeded:
  `draft_seed_offset(count + a + 1, 1)`), picked at extra + the accept length. Seeded rows
  take `stream_draws` (the numbers the per-forward path draws); the others the host's
  global RNG.

Which batches: `static_sampling.plain_sampling`'s."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt_ascend.decoding.base import StepRequest
from srt_ascend.sampling.static_sampling import SETTINGS, Settings, fill_settings, padding_block
from srt_ascend.speculative.mtp_worker import stream_draws


def columns(k_max: int) -> int:
    """Width of the block for rounds of up to `k_max` drafts: the settings, then per count
    candidate (C = k_max + 1 of them) draft steps' and the verify's uniforms, then the next
    d_1's candidates (C + k_max)."""
    return _offsets(k_max)[2] + (k_max + 1) + k_max


def padding_rows(n: int, k_max: int, device="cpu") -> torch.Tensor:
    """`n` padding rows of the block (`static_sampling.padding_block`)."""
    return padding_block(n, device, columns(k_max))


def _offsets(k_max: int) -> tuple[int, int, int]:
    """Where the block's draft-step, verify and next-d_1 uniforms start."""
    chain = SETTINGS
    verify = chain + (k_max + 1) * (k_max - 1)
    return chain, verify, verify + (k_max + 1) * (k_max + 1)


def host_block(
    reqs: Sequence[StepRequest],
    low: Sequence[int],  # tokens each generated before the round: the lowest count it may have
    span: int,  # counts low .. low+span-1 (1: exact; an overlapped round's range: `Counts`)
    k: int,
    k_max: int,
    bucket: int,
    vocab: int,
) -> torch.Tensor:  # [bucket, columns(k_max)] float32 on the host
    """The block the sampled round graph reads: its rows' settings and, for each count the
    row may have, its uniforms (module docstring); padding rows past the batch. A seeded
    row's are its streams' (`stream_draws`, as `stream_uniforms` draws them)."""
    block = padding_rows(bucket, k_max)
    c = k_max + 1
    chain, verify, nxt = _offsets(k_max)
    fill_settings(block, reqs, vocab)
    n = len(reqs)
    block[:n, SETTINGS:] = 1.0 - torch.rand(n, block.shape[1] - SETTINGS)  # unseeded rows
    for i, (r, g) in enumerate(zip(reqs, low)):
        p, row = r.sampling_params, block[i]
        if p.seed is None or p.is_greedy:  # the global RNG (a greedy row's decide nothing)
            continue
        steps = row[chain:verify].view(c, k_max - 1)
        verifies = row[verify:nxt].view(c, k_max + 1)
        for j in range(1, k):  # draft step j draws draft j+1
            steps[:span, j - 1] = 1.0 - stream_draws(r, j + 1, 1, g, span)[:, 0]
        verifies[:span, : k + 1] = 1.0 - stream_draws(r, 0, k + 1, g, span)
        row[nxt : nxt + span + k] = 1.0 - stream_draws(r, 1, 1, g + 1, span + k)[:, 0]
    return block


class RowSettings(Settings):
    """Views of the block (`host_block`) for the first `bs` rows of a round of K drafts,
    inside the graph; `extra` [B]: each row's count past its lowest (0 in a serial round)."""

    def __init__(
        self, block: torch.Tensor, extra: torch.Tensor, k: int, k_max: int, filtered: bool
    ) -> None:
        bs, c = extra.shape[0], k_max + 1
        rows = block[:bs]
        super().__init__(rows, filtered)
        chain, verify, nxt = _offsets(k_max)
        self.extra = extra
        self.u_chain = _at(rows[:, chain:verify].reshape(bs, c, k_max - 1), extra)[:, : k - 1]
        self.u_verify = _at(rows[:, verify:nxt].reshape(bs, c, k_max + 1), extra)[:, : k + 1]
        self._next = rows[:, nxt : nxt + c + k_max]

    def u_next(self, accept_len: torch.Tensor) -> torch.Tensor:  # [B]
        """The next d_1's uniform: the candidate of the count the round leaves."""
        return self._next.gather(1, (self.extra + accept_len).view(-1, 1)).squeeze(1)


def _at(candidates: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """[B, C, n] -> [B, n]: each row's candidate `pick` [B]."""
    index = pick.view(-1, 1, 1).expand(-1, 1, candidates.shape[-1])
    return candidates.gather(1, index).squeeze(1)
