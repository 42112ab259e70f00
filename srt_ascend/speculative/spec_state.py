"""Per-request speculative state, owned by the MTP decoder (Req.decoder_state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecState:
    """The first draft d_1 waiting for the next step, and what drafted it, on the device
    (views into the batch that drafted it); drafts d_2..d_K live only inside a step. After
    K = 0 steps (plain decoding, --speculative-adaptive) the MTP passes they skipped wait in
    `deferred`: the target hidden of positions deferred_start, deferred_start + 1, ... (in
    chunks of rows, as the steps kept them: `deferred_len` rows in all); d_1
    is then None until the next step with drafts runs them. On the host: the request's moving
    acceptance estimate per draft position (draft_length), and a seeded request's draws of
    the streams its next rounds may read."""

    token: torch.Tensor | None = None  # [] d_1; None: no draft yet
    # [V] the processed draft distribution d_1 was sampled from; None for a greedy draft (its
    # distribution is one-hot at the token)
    probs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # [D] the MTP module's output (feeds re-application)
    acceptance: list[float] | None = None  # [K] P(draft j accepted | drafts before accepted)
    deferred: list[torch.Tensor] = field(default_factory=list)  # [m, D] each, on the device
    deferred_start: int = 0  # position of deferred[0]'s first row
    deferred_len: int = 0  # rows in `deferred`
    # seeded streams' host draws by (draft j, 0 for the target's; draws) and generated count,
    # the counts an overlapped round may start at and those after (`mtp_worker.stream_draws`)
    draws: dict[tuple[int, int], dict[int, torch.Tensor]] = field(default_factory=dict)


def state_of(req) -> SpecState:
    """The request's SpecState (Req.decoder_state), made on first use."""
    if req.decoder_state is None:
        req.decoder_state = SpecState()
    return req.decoder_state
