"""ServerArgs' memory and scheduling flags: the KV pool, chunked prefill, admission, attention
kernels, CPU threads, determinism, streaming, logs, the idle KV check, overlap scheduling."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

ATTENTION_BACKENDS = ("torch_native", "triton")
# --attention-backend when the flag is not given, by platform name (others: torch_native)
DEFAULT_ATTENTION_BACKEND = {"cuda": "triton"}


class SchedulingArgsMixin:
    """ServerArgs' scheduling properties (no fields: those are ServerArgs')."""

    def attention_backend_on(self, platform_name: str) -> str:
        """The attention backend to build on that platform: the flag's value, else the
        platform's default (triton on CUDA, torch_native elsewhere)."""
        if self.attention_backend is not None:
            return self.attention_backend
        return DEFAULT_ATTENTION_BACKEND.get(platform_name, "torch_native")


def add_scheduling_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    """Batching and memory, kernels, then output and checks (in --help's order)."""
    _add_batching_flags(parser, d)
    _add_kernel_flags(parser)
    _add_reporting_flags(parser, d)


def _add_batching_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    a = parser.add_argument
    a(
        "--max-running-requests",
        type=int,
        default=d["max_running_requests"].default,
        help="max requests in the running batch",
    )
    a(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (overrides --mem-fraction-static)",
    )
    a(
        "--mem-fraction-static",
        type=float,
        default=d["mem_fraction_static"].default,
        help="fraction of device (CPU: system) memory for the KV pool",
    )
    a(
        "--chunked-prefill-size",
        type=int,
        default=d["chunked_prefill_size"].default,
        help="max prefill tokens per forward; -1 disables chunking",
    )
    a(
        "--page-size",
        type=int,
        default=None,
        help="KV pool page size in tokens (default: 128 on NPU, FIA's block size; else 1)",
    )
    a("--disable-radix-cache", action="store_true", help="no prefix sharing")
    a(
        "--schedule-policy",
        default="fcfs",
        choices=["fcfs", "lpm"],
        help="waiting-queue order: first come first served, or longest prefix match",
    )


def _add_kernel_flags(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--attention-backend",
        default=None,
        choices=list(ATTENTION_BACKENDS),
        help="attention kernels (default: triton on CUDA, torch_native on CPU and NPU)",
    )
    a(
        "--num-threads",
        type=int,
        default=None,
        help="CPU: torch intra-op threads (default: torch's); compiled forwards run with "
        "at most one fewer than the process's cores, leaving one to its other threads",
    )
    a(
        "--cpu-small-gemm",
        default="auto",
        choices=["auto", "on", "off"],
        help="CPU: run bf16/fp16 matmuls of at most 2^18 multiply-adds through MKL instead "
        "of oneDNN, whose fixed per-call cost dominates them (auto: on where torch has MKL)",
    )
    a(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels: every position's result depends on its token prefix "
        "alone, so outputs do not change with batch composition, chunked prefill, radix "
        "hits, graphs or speculation (MTP on or off); CPU only (refused elsewhere)",
    )


def _add_reporting_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    a = parser.add_argument
    a(
        "--stream-interval",
        type=int,
        default=1,
        help="stream every N tokens (the first at once, the rest with the finish)",
    )
    a(
        "--decode-log-interval",
        type=int,
        default=d["decode_log_interval"].default,
        help="log SGLang's 'Decode batch.' line every N decode steps",
    )
    a(
        "--enable-metrics",
        action="store_true",
        help="accepted for SGLang's scripts: /metrics is always served",
    )
    a(
        "--enable-cache-report",
        action="store_true",
        help="accepted for SGLang's scripts: usage always reports cached tokens",
    )
    a(
        "--kv-invariant-check",
        default="log",
        choices=["log", "fatal"],
        help="when the scheduler goes idle it checks that every KV slot and request row is "
        "free or owned by the prefix cache; log a mismatch, or stop the scheduler (tests)",
    )


def add_overlap_flags(parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]) -> None:
    """--disable/--enable-overlap-schedule (listed after the disaggregation flags in --help)."""
    a = parser.add_argument
    a(
        "--disable-overlap-schedule",
        action="store_true",
        help="run each decode step's forward after the previous step's results are "
        "committed (the serial loop) instead of overlapping them",
    )
    a(
        "--enable-overlap-schedule",
        action="store_true",
        help="overlap decode steps where the platform runs them serially by default "
        "(eager forwards on CPU, which hold the GIL op by op)",
    )
