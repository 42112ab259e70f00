"""ServerArgs' prefill-decode disaggregation flags (docs/disaggregation.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

DISAGGREGATION_MODES = ("null", "prefill", "decode")


class DisaggregationArgsMixin:
    """ServerArgs' disaggregation properties and checks (no fields: those are ServerArgs')."""

    @property
    def disaggregated(self) -> bool:
        """A prefill or decode server of a disaggregated pair (not `null`)."""
        return self.disaggregation_mode != "null"

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend != "mooncake":
            raise ValueError(
                f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend!r} is "
                "not available here (accepted: mooncake)"
            )
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("--disaggregation-bootstrap-port must be in [1, 65535]")
        if self.disaggregation_timeout <= 0:
            raise ValueError("--disaggregation-timeout must be > 0")
        if not self.disaggregated:
            return
        if self.enable_dp_attention:
            raise ValueError(
                "--disaggregation-mode cannot be combined with --enable-dp-attention (yet)"
            )


def add_disaggregation_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    a = parser.add_argument
    a(
        "--disaggregation-mode",
        default="null",
        choices=list(DISAGGREGATION_MODES),
        help="prefill-decode disaggregation behind sglang-router --pd-disaggregation: "
        "prefill (computes prompts, sends their KV), decode (receives it, generates), or "
        "null (both, one server)",
    )
    a(
        "--disaggregation-transfer-backend",
        default="mooncake",
        help="how KV moves between the servers: mooncake (Mooncake's transfer engine; pip "
        "install srt-ascend[pd])",
    )
    a(
        "--disaggregation-bootstrap-port",
        type=int,
        default=d["disaggregation_bootstrap_port"].default,
        help="prefill server: the port of its bootstrap endpoint, where decode servers "
        "say where a request's KV goes (give the router the same port)",
    )
    a(
        "--disaggregation-ib-device",
        default=None,
        help="RDMA device(s) for the transfer engine, e.g. mlx5_0; none: TCP",
    )
    a(
        "--disaggregation-timeout",
        type=float,
        default=d["disaggregation_timeout"].default,
        help="seconds a disaggregated request waits for its peer (the decode server's "
        "registration on the prefill side, the KV on the decode side) before it fails",
    )
