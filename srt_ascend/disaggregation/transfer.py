"""Mooncake's transfer engine over this server's KV pool: registration of the pool's buffers
and batched writes of slot runs into a peer's pool (TCP, or RDMA with
--disaggregation-ib-device; Mooncake's Ascend build moves NPU memory the same way)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

METADATA = "P2PHANDSHAKE"  # peers exchange segment descriptors directly, no metadata server


class TransferError(RuntimeError):
    """A write to the peer failed (the engine's status, or the peer is gone)."""


def slot_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, n) for each maximal run of positions whose source and
    destination slots both go up by one: each run is one write per buffer."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def write_plan(
    runs: list[tuple[int, int, int]],
    src_buffers: Sequence[int],
    dst_buffers: Sequence[int],
    row_bytes: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """The engine's (source addresses, destination addresses, lengths) for slot `runs` in
    every buffer pair (one entry per run and buffer)."""
    srcs, dsts, lens = [], [], []
    for sb, db, rb in zip(src_buffers, dst_buffers, row_bytes):
        for s, d, n in runs:
            srcs.append(sb + s * rb)
            dsts.append(db + d * rb)
            lens.append(n * rb)
    return srcs, dsts, lens


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    writes: int = 0  # engine entries written (runs x buffers)


class KVTransfer:
    """One transfer engine per server. `register` the tensors peers write into or read from
    (the KV pool's buffers, the MTP staging buffers) before the first transfer; `write` is
    synchronous and thread-safe."""

    def __init__(self, hostname: str, ib_device: str | None) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "--disaggregation-transfer-backend mooncake needs Mooncake's transfer engine: "
                f"pip install 'srt-ascend[pd]' (and apt-get install libibverbs1 librdmacm1): {e}"
            ) from None
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self.engine.initialize(hostname, METADATA, protocol, ib_device or "") != 0:
            raise RuntimeError(f"the transfer engine did not start ({protocol} on {hostname})")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self.stats = TransferStats()
        self._lock = threading.Lock()
        logger.info("transfer engine: %s over %s", self.session_id, protocol)

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if self.engine.register_memory(t.data_ptr(), nbytes) != 0:
                raise RuntimeError(f"the transfer engine could not register {nbytes} bytes")

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Writes every (src, dst, len) into peer `session` in one batch; TransferError if
        any part failed. Counted in `stats` (bytes and seconds of the writes that worked)."""
        started = time.perf_counter()
        status = self.engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        seconds = time.perf_counter() - started
        with self._lock:
            if status != 0:
                self.stats.failures += 1
                raise TransferError(f"the KV transfer to {session} failed (status {status})")
            self.stats.bytes += sum(lens)
            self.stats.seconds += seconds
            self.stats.writes += len(lens)
