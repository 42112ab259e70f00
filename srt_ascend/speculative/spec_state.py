"""Per-request speculative state, owned by the MTP decoder (Req.decoder_state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecState:
    """The drafts waiting for the next verify step, and what drafted them."""

    draft_tokens: list[int] = field(default_factory=list)  # d_1..d_K
    # [V] the processed draft distribution each draft was sampled from; None for a greedy
    # draft (its distribution is one-hot at the token)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [D] the MTP module's last output (feeds re-application)

    def restart(self) -> None:
        """Drops the chain: the next draft is d_1."""
        self.draft_tokens, self.draft_probs = [], []
