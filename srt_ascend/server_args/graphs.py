"""ServerArgs' graph flags: graph capture (CUDA, NPU, CPU replay) and torch.compile."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping


class GraphArgsMixin:
    """ServerArgs' graph properties (no fields: those are ServerArgs')."""

    def graphs_enabled(self, platform) -> bool:
        """Graphs are on by default where the platform has real ones (CUDA, NPU); on CPU
        only with --enable-cpu-graph or --enable-torch-compile (which compiles the graph
        runner's forwards); never with --disable-cuda-graph, nor with --moe-a2a-backend
        all_to_all (its split sizes are host integers read per MoE layer). Under
        data-parallel attention every rank replays the same graph (model_executor/dp_graph)."""
        if self.disable_cuda_graph or self.moe_a2a_backend == "all_to_all":
            return False
        return platform.graphs_by_default or self.enable_cpu_graph or self.enable_torch_compile


def add_graph_flags(parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]) -> None:
    a = parser.add_argument
    a(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode, verify and MTP draft forwards eagerly (graphs are on by default "
        "on CUDA and NPU)",
    )
    a(
        "--enable-cpu-graph",
        action="store_true",
        help="on CPU, run those forwards through the graph runner's eager replay over "
        "static buffers (exercises capture/pad/replay; no speed-up on CPU)",
    )
    a(
        "--cuda-graph-bs",
        "--graph-batch-sizes",
        dest="cuda_graph_bs",
        type=int,
        nargs="+",
        default=None,
        help="batch-size buckets to capture (default 1 2 4 8 12 16 24 32, then multiples "
        "of 16, up to --cuda-graph-max-bs)",
    )
    a(
        "--cuda-graph-max-bs",
        type=int,
        default=32,
        help="largest captured batch size; bigger batches run eagerly",
    )
    a(
        "--disable-mtp-round-graph",
        action="store_true",
        help="MTP: replay each forward of a round from its own graph instead of capturing "
        "the whole round (drafts, verify, greedy acceptance, MTP pass) as one graph per "
        "batch bucket for all-greedy batches",
    )
    a(
        "--enable-torch-compile",
        action="store_true",
        help="compile the graph runner's decode, verify and MTP draft forwards with "
        "torch.compile (inductor; on CPU the C++ wrapper, on CUDA inside CUDA graphs); "
        "artifacts cached in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/srt_ascend/inductor)",
    )
    a(
        "--torch-compile-max-bs",
        type=int,
        default=32,
        help="largest batch-size bucket that is compiled; bigger buckets are captured uncompiled",
    )
    a(
        "--torch-compile-at-start",
        action="store_true",
        help="with --enable-torch-compile, compile every shape before serving; by default "
        "the server serves at once (uncompiled) and compiles one shape at a time while it "
        "has no request, progress in /server_info",
    )
