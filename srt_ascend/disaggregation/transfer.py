"""Mooncake's transfer engine over this server's KV pool: registration of the pool's buffers
and batched writes of slot runs into a peer's pool (TCP, or RDMA with
--disaggregation-ib-device; Mooncake's Ascend build moves NPU memory the same way), and the
prefill server's queue that runs those writes off its scheduler's thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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

    def counters(self, other_failures: int = 0) -> dict:
        """The server-info / metrics counters: bytes, seconds and failures (the engine's and
        `other_failures`, the server's own: timeouts, refused registrations)."""
        return {
            "kv_transfer_bytes": self.bytes,
            "kv_transfer_seconds": self.seconds,
            "kv_transfer_failures": self.failures + other_failures,
        }


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


# (session, source addresses, destination addresses, lengths): one engine batch
Write = tuple[str, list[int], list[int], list[int]]


class TransferQueue:
    """The prefill server's transfers, off the scheduler's thread: `put(lane, key, writes)`
    queues a request's engine batches; a thread per lane (one per decode server: its rank 0's
    session) runs its jobs in order and calls `done(key, error)` after each (error None: every
    batch written; else why not). Lanes are apart, so a decode server that hangs holds up
    only its own transfers; a lane's thread ends when its queue is empty.

    A thread and the engine's synchronous batch write, not `batch_transfer_async_write`: the
    async call still opens the peer's segment (a handshake with it) in the caller's thread,
    and its status call blocks until the batch is done, so a thread is needed either way."""

    def __init__(self, transfer: KVTransfer, done: Callable[[Any, str | None], None]) -> None:
        self.transfer = transfer
        self.done = done
        self._lanes: dict[str, list[tuple[Any, list[Write]]]] = {}
        self._lock = threading.Lock()

    def put(self, lane: str, key: Any, writes: list[Write]) -> None:
        with self._lock:
            jobs = self._lanes.get(lane)
            if jobs is not None:  # its thread is running: it takes this one next
                jobs.append((key, writes))
                return
            self._lanes[lane] = [(key, writes)]
        threading.Thread(
            target=self._run, args=(lane,), name="disagg-transfer", daemon=True
        ).start()

    def _run(self, lane: str) -> None:
        while True:
            with self._lock:
                jobs = self._lanes[lane]
                if not jobs:
                    del self._lanes[lane]
                    return
                key, writes = jobs.pop(0)
            error = None
            try:
                for session, srcs, dsts, lens in writes:
                    self.transfer.write(session, srcs, dsts, lens)
            except TransferError as e:
                error = str(e)
            except Exception as e:  # the engine's binding raising: still the request's end
                logger.exception("KV transfer on lane %s raised", lane)
                error = f"the KV transfer failed: {e}"
            self.done(key, error)
