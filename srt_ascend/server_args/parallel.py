"""ServerArgs' parallelism flags: tensor and expert parallelism, nodes, data-parallel
attention and its load balancing, MoE all-to-all."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
# --moe-a2a-backend values served here. "none" (SGLang's default and meaning): torch.distributed's
# all-gather + all-reduce (every rank already holds, or gathers, all tokens). "all_to_all" (ours,
# not an SGLang value): torch.distributed's all-to-all sends each token to its experts' ranks,
# under expert parallelism with DP attention. SGLang's other values (deepep mooncake nixl mori
# ascend_fuseep flashinfer) are vendor all-to-all libraries, not available here.
MOE_A2A_BACKENDS = ("none", "all_to_all")


class ParallelArgsMixin:
    """ServerArgs' parallelism properties and checks (no fields: those are ServerArgs')."""

    @property
    def attn_dp_size(self) -> int:
        """Data-parallel attention groups (1 without --enable-dp-attention)."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one DP group's attention heads (and the vocabulary)."""
        return self.tp_size // self.attn_dp_size

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep-size must be 1 or --tp-size ({self.tp_size}): experts are partitioned "
                f"over the tensor-parallel ranks, got {self.ep_size}"
            )
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"--nnodes ({self.nnodes}) must be >= 1 and divide --tp-size ({self.tp_size})"
            )
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                "--dp-size > 1 needs --enable-dp-attention (for data-parallel replicas run "
                "several servers behind sglang-router)"
            )
        if self.tp_size % self.dp_size:
            raise ValueError(
                f"--dp-size ({self.dp_size}) must divide --tp-size ({self.tp_size}): each DP "
                "group's attention runs on tp/dp ranks"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"unknown --load-balance-method {self.load_balance_method!r} "
                f"({', '.join(LOAD_BALANCE_METHODS)})"
            )
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(
                f"--moe-a2a-backend {self.moe_a2a_backend!r} is not available here (accepted: "
                f"{', '.join(MOE_A2A_BACKENDS)}: torch.distributed's collectives; SGLang's vendor "
                "all-to-all libraries are not)"
            )
        if self.moe_a2a_backend == "all_to_all" and (self.ep_size == 1 or self.attn_dp_size == 1):
            raise ValueError(
                "--moe-a2a-backend all_to_all needs --ep-size > 1 and --enable-dp-attention "
                "--dp-size > 1 (without DP attention every rank already holds every token: "
                "nothing to dispatch)"
            )
        if self.dist_timeout is not None and self.dist_timeout < 1:
            raise ValueError("--dist-timeout must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")


def add_parallel_flags(parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]) -> None:
    """Model parallelism, then data-parallel attention and expert dispatch, then the nodes (in
    --help's order)."""
    _add_model_parallel_flags(parser)
    _add_dp_flags(parser)
    _add_node_flags(parser, d)


def _add_model_parallel_flags(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor-parallel ranks: one scheduler/model process each (attention heads, "
        "MLP and expert intermediate rows, vocabulary split across them)",
    )
    a(
        "--ep-size",
        "--expert-parallel-size",
        dest="ep_size",
        type=int,
        default=1,
        help="expert parallelism: 1, or --tp-size to partition the routed experts over "
        "the tensor-parallel ranks (each holds whole experts; the shared expert is "
        "replicated) instead of splitting every expert's intermediate rows",
    )
    a(
        "--dist-init-addr",
        "--nccl-init-addr",
        dest="dist_init_addr",
        default=None,
        help="HOST:PORT where the ranks meet (torch.distributed TCP rendezvous on node 0; "
        "default: a free port on 127.0.0.1, one node only)",
    )
    a("--nnodes", type=int, default=1, help="nodes the --tp-size ranks are spread over")


def _add_dp_flags(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention: the --tp-size ranks form --dp-size groups, each "
        "scheduling its own requests with attention split over tp/dp ranks; MoE and MLP "
        "layers run over every group's tokens on all ranks (graphs: every rank replays "
        "the same bucket, padded)",
    )
    a(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="data-parallel attention groups (needs --enable-dp-attention; divides --tp-size)",
    )
    a(
        "--load-balance-method",
        default="round_robin",
        choices=list(LOAD_BALANCE_METHODS),
        help="which DP group a new request goes to: in turn, or the one with the fewest requests",
    )
    a(
        "--moe-a2a-backend",
        default="none",
        help="expert-parallel token dispatch/combine over torch.distributed: none "
        "(all-gather + all-reduce) or all_to_all (each token to its experts' ranks; needs "
        "--ep-size > 1 and --enable-dp-attention; runs eagerly: graphs off); SGLang's "
        "vendor all-to-all backends are not available here",
    )


def _add_node_flags(parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]) -> None:
    a = parser.add_argument
    a(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index (0: the node that serves HTTP; others run ranks only)",
    )
    a(
        "--dist-timeout",
        type=int,
        default=d["dist_timeout"].default,
        help="seconds a torch.distributed collective (and the rendezvous) waits for a "
        "peer before the server ends; longer than the slowest rank's model load",
    )
