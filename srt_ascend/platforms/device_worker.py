"""Where a step's device work runs relative to the scheduler's Python (overlap scheduling).

A DeviceWorker takes closures that do device work (forwards, sampling) and runs them in the
order they were submitted; `submit` returns a Future whose `result()` waits until the closure
has run. The overlap scheduler submits step N+1 and then commits step N while it runs.

- `InlineWorker` (CUDA, NPU, and every serial loop): the closure runs at once in the caller's
  thread. On an accelerator it only enqueues kernels on the current stream and returns; the
  host read of its result (`utils.HOST_READS`) is where the host waits for the device, as a
  CUDA/NPU stream and its events order work without a thread.
- `HostCopy` (`Platform.copy_to_host`): a step's result on its way to the host. On an
  accelerator the closure ends with a non-blocking copy into pinned memory and an event
  recorded after it, both enqueued before the next step's forward; the finish that reads
  the result waits on that event alone, while the next step runs. On CPU it is the tensor.
- `ThreadWorker` (CPU): there is no asynchronous device, so the closures run on one thread,
  the CPU analogue of a stream. `start_scheduler_thread` has the thread that built the model
  serve it (`serve`), so every forward keeps running in that thread, whose OpenMP team the
  model load already started: a forward in a second thread would start a second team, and
  libgomp throttles its spin-waits once more OpenMP threads than cores exist.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


class DeviceWorker(ABC):
    # True: someone must call `serve` on a thread (else the first submit starts its own)
    needs_serving_thread = False

    @abstractmethod
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Runs `fn` after everything submitted before it; the Future holds its result or
        the exception it raised."""

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn` run in order after the submitted work, waited for; its exception re-raised."""
        return self.submit(fn).result()

    def close(self) -> None:  # noqa: B027 - nothing to stop inline
        """No more work: a serving thread returns once the queue is done."""


class InlineWorker(DeviceWorker):
    def submit(self, fn: Callable[[], Any]) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn())
        except Exception as e:  # handed to whoever reads the result, as a thread would
            done.set_exception(e)
        return done


class ThreadWorker(DeviceWorker):
    """Closures run in submission order on one thread: the one that calls `serve` (after
    `claim`), or else a daemon thread started by the first `submit`. A closure submitted from
    the serving thread itself runs at once (it is next in order anyway)."""

    needs_serving_thread = True

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._claimed = False
        self._serving: int | None = None  # the serving thread's ident
        self._lock = threading.Lock()

    def claim(self) -> None:
        """A thread will call `serve`: `submit` must not start one of its own."""
        self._claimed = True

    def submit(self, fn: Callable[[], Any]) -> Future:
        if threading.get_ident() == self._serving:
            return InlineWorker().submit(fn)
        with self._lock:
            if not self._claimed:
                self._claimed = True
                threading.Thread(target=self.serve, name="srt-device", daemon=True).start()
        done: Future = Future()
        self._queue.put((fn, done))
        return done

    def serve(self) -> None:
        """Runs submitted closures on the calling thread until `close`."""
        self._serving = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, done = item
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised by the reader of the result
                done.set_exception(e)

    def close(self) -> None:
        self._queue.put(None)


@dataclass
class HostCopy:
    """A device result on its way to the host. `data` is a host tensor (pinned memory that a
    non-blocking copy writes, on an accelerator; the result itself on CPU), valid once `ready`
    - an event recorded on the stream after the copy, None when valid now - has completed.
    `wait` blocks on that event alone, never on work enqueued after it (the next step)."""

    data: torch.Tensor
    ready: Any = None  # torch.cuda.Event / torch.npu.Event, or None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.data
