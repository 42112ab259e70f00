"""Per-request token statistics for the penalties, kept on the device and brought up to date
incrementally (SGLang's penaltylib keeps the same state per batch).

A request with a repetition, frequency or presence penalty gets a PenaltyState at its first
sampled position: the set of its prompt's tokens (built once) and the count of each token of
its output, to which each later call adds only the tokens committed since. The batch's [B, V]
tensors are stacked from the rows on the device; no token list crosses to the device again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.utils import to_device


class PenalisedRequest(Protocol):
    """What the penalty state reads of a request; `penalty_state` is owned by this module."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]  # grows only (a shorter list rebuilds the state)
    penalty_state: PenaltyState | None


@dataclass
class PenaltyState:
    """One request's statistics on the device."""

    counts: torch.Tensor  # [V] int32: times each token occurs in output_ids[:counted]
    prompt: torch.Tensor  # [V] bool: tokens of origin_input_ids
    counted: int  # output tokens included in `counts`


def has_penalties(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


def penalty_tensors(
    reqs: Sequence[PenalisedRequest], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] int32 counts, [B, V] bool prompt tokens
    """The batch's output-token counts and prompt-token masks (rows of requests without
    penalties are zeros: their penalties are neutral). Creates or updates each penalised
    request's `penalty_state` with the tokens it committed since the last call: one host copy
    of those tokens (and of the prompts of requests new to penalties) for the whole batch.
    The returned tensors are new; the requests' states are rows of them afterwards (read-only
    for the caller)."""
    rows = [i for i, r in enumerate(reqs) if has_penalties(r.sampling_params)]
    kept: list[PenaltyState | None] = [None] * len(reqs)  # states brought forward
    fresh: list[int] = []  # requests whose state is (re)built now, prompt mask included
    new_rows: list[int] = []  # (row, token) of the output tokens counted now
    new_ids: list[int] = []
    for i in rows:
        r, state = reqs[i], reqs[i].penalty_state
        if state is None or state.counted > len(r.output_ids):
            fresh.append(i)
        else:
            kept[i] = state
        start = 0 if kept[i] is None else state.counted
        new_rows += [i] * (len(r.output_ids) - start)
        new_ids += r.output_ids[start:]
    zeros_c = torch.zeros(vocab, dtype=torch.int32, device=device)
    zeros_p = torch.zeros(vocab, dtype=torch.bool, device=device)
    counts = torch.stack([zeros_c if s is None else s.counts for s in kept])
    prompt = torch.stack([zeros_p if s is None else s.prompt for s in kept])
    in_rows = [i for i in fresh for _ in reqs[i].origin_input_ids]
    in_ids = [t for i in fresh for t in reqs[i].origin_input_ids]
    if new_ids or in_ids:  # one copy: [[rows...], [ids...]], output tokens first
        index = to_device([new_rows + in_rows, new_ids + in_ids], device)
        n = len(new_ids)
        ones = torch.ones(n, dtype=torch.int32, device=device)
        counts.index_put_((index[0, :n], index[1, :n]), ones, accumulate=True)
        prompt[index[0, n:], index[1, n:]] = True
    for i in rows:
        reqs[i].penalty_state = PenaltyState(counts[i], prompt[i], len(reqs[i].output_ids))
    return counts, prompt
