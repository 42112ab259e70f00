"""The device workers the overlap scheduler submits steps to: closures run in submission order
on one thread (the serving one, or their own), exceptions reach whoever reads the result, a
closure submitted from the serving thread runs at once, and `close` ends `serve`."""

from __future__ import annotations

import threading

import pytest

from srt_ascend.platforms import get_platform
from srt_ascend.platforms.device_worker import InlineWorker, ThreadWorker


def test_cpu_platform_gives_a_thread_worker():
    assert isinstance(get_platform("cpu").new_device_worker(), ThreadWorker)


def test_thread_worker_runs_in_order_on_the_serving_thread():
    worker = ThreadWorker()
    worker.claim()
    gate = threading.Event()
    seen: list[tuple[int, int]] = []

    def job(i):
        def run():
            if i == 0:
                gate.wait(10)  # later closures queue behind it
            seen.append((i, threading.get_ident()))
            return i * i

        return run

    def loop():
        futures = [worker.submit(job(i)) for i in range(20)]
        assert not futures[19].done()  # queued behind the first, not run in this thread
        gate.set()
        assert [f.result(10) for f in futures] == [i * i for i in range(20)]
        worker.close()

    t = threading.Thread(target=loop)
    t.start()
    worker.serve()  # this thread serves until the loop closes the worker
    t.join(10)
    assert [i for i, _ in seen] == list(range(20))
    assert {ident for _, ident in seen} == {threading.get_ident()}


def test_thread_worker_hands_exceptions_to_the_reader_and_goes_on():
    worker = ThreadWorker()  # not claimed: the first submit starts its own thread

    def boom():
        raise RuntimeError("step failed")

    failed = worker.submit(boom)
    assert worker.run(lambda: 7) == 7
    with pytest.raises(RuntimeError, match="step failed"):
        failed.result(10)
    with pytest.raises(RuntimeError, match="step failed"):
        worker.run(boom)
    # a closure that submits from the serving thread runs at once instead of deadlocking
    assert worker.run(lambda: worker.run(lambda: 3) + 1) == 4
    worker.close()


def test_inline_worker_runs_at_once():
    worker = InlineWorker()
    ran = []
    done = worker.submit(lambda: ran.append(1) or 5)
    assert ran == [1] and done.done() and done.result() == 5
    with pytest.raises(ZeroDivisionError):
        worker.run(lambda: 1 / 0)
