"""ServerArgs' speculative decoding flags (MTP): draft length, verify path, acceptance, adaptive
K."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

MAX_SPEC_STEPS = 15  # FIA's 16-query-token limit per request: 1 + K <= 16


class SpeculativeArgsMixin:
    """ServerArgs' speculative properties and checks (no fields: those are ServerArgs')."""

    @property
    def spec_enabled(self) -> bool:
        return self.speculative_algorithm is not None

    def _check_speculative(self) -> None:
        if self.speculative_algorithm != "MTP":
            raise ValueError(
                f"unknown --speculative-algorithm {self.speculative_algorithm!r} (supported: MTP)"
            )
        k = self.speculative_num_steps
        if not 1 <= k <= MAX_SPEC_STEPS:
            raise ValueError(f"--speculative-num-steps must be in [1, {MAX_SPEC_STEPS}], got {k}")
        n = self.speculative_num_draft_tokens
        if n is not None and n != k + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = {k + 1} "
                f"(chains only), got {n}"
            )
        if self.speculative_eagle_topk != 1:
            raise ValueError("--speculative-eagle-topk must be 1: MTP drafts a single chain")
        if self.speculative_verify not in (None, "expand", "fia"):
            raise ValueError("--speculative-verify must be 'expand' or 'fia'")
        if self.speculative_adaptive and self.tp_size > 1:
            raise ValueError(
                "--speculative-adaptive needs --tp-size 1: it chooses K from this process's "
                "step times, which the ranks would not agree on"
            )
        if self.speculative_accept_method not in ("token", "block"):
            raise ValueError(
                f"--speculative-accept-method must be token or block, "
                f"got {self.speculative_accept_method!r}"
            )


def add_speculative_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    a = parser.add_argument
    a("--speculative-algorithm", default=None, help="MTP to enable speculative decoding")
    a("--speculative-num-steps", type=int, default=1, help="draft tokens per step K (1-15)")
    a(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="tokens verified per request per step; must be K + 1",
    )
    a("--speculative-eagle-topk", type=int, default=1, help="must be 1 (chains only)")
    a(
        "--speculative-verify",
        default=None,
        choices=["expand", "fia"],
        help="verify by batch expansion or by one multi-query FIA forward (default: fia; on "
        "NPU fia where the model's shape fits the op, else expand)",
    )
    a(
        "--speculative-accept-method",
        default="token",
        choices=["token", "block"],
        help="how sampled drafts are accepted: token-wise rejection sampling, or block "
        "verification (Sun et al. 2025: lossless, accepts at least as many in expectation)",
    )
    a(
        "--speculative-adaptive",
        action="store_true",
        help="choose the drafts per step (0..--speculative-num-steps) from the batch size, "
        "each request's recent acceptance per draft position and the measured step cost",
    )
