"""Overlap that overlaps on a device: a launched step leaves its result on the way to the host
(`Platform.copy_to_host`: on an accelerator a non-blocking copy into pinned memory and an
event recorded after it), enqueued before the next step's forward, and its finish waits on
that event alone - never on the step launched after it.

A recording platform stands in for the device queue: it logs every forward, every copy with
its event, and every wait, in enqueue order (the inline worker enqueues a step's work at its
launch, as on CUDA). The plain decoder and MTP rounds (greedy and seeded sampling) run the
scheduler's overlapped order - launch N, launch N+1, finish N, ... - and their outputs equal
the serial loop's (tests/engine/test_overlap.py covers that at scale)."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.decoding.base import DecoderHandles, create_decoder
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.platforms.device_worker import HostCopy, InlineWorker
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs
from srt_ascend.speculative import mtp_decoder  # noqa: F401  (registers "MTP")


class Event:
    def __init__(self, log: list[str], n: int) -> None:
        self.log, self.n = log, n

    def synchronize(self) -> None:
        self.log.append(f"wait{self.n}")


def recording_platform(log: list[str]):
    """The CPU platform whose device queue is logged: copies with their events, full syncs."""
    base = type(get_platform("cpu"))

    class Recording(base):
        def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
            n = sum(e.startswith("copy") for e in log) + 1
            log.append(f"copy{n}")
            return HostCopy(tensor.clone(), Event(log, n))

        def synchronize(self) -> None:
            log.append("sync")

    return Recording()


class TableKV:
    """A KVHandle over the request table: slots from a counter, written where each request's
    positions end."""

    page_size = 1

    def __init__(self, pool) -> None:
        self.pool, self.next = pool, 1

    def try_alloc_running(self, reqs, n):
        counts = n if isinstance(n, list) else [n] * len(reqs)
        loc = torch.arange(self.next, self.next + sum(counts))
        self.next += sum(counts)
        self.pool.write([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], loc, counts)
        for r, c in zip(reqs, counts):
            r.alloc_len = r.kv_len + c
        return loc

    def alloc_running(self, reqs, n):
        return reqs, self.try_alloc_running(reqs, n)

    def free_positions(self, req, lo, hi) -> None:
        pass

    def free_positions_many(self, reqs, los, his) -> None:
        pass


def _commit(req, tokens, logprobs=None) -> None:
    req.output_ids.extend(tokens)


def _setup(algorithm: str | None, log: list[str]):
    args = ServerArgs(
        model_path=SHIPPED_MODEL,
        dtype="float32",
        speculative_algorithm=algorithm,
        speculative_num_steps=2,
        speculative_verify="expand" if algorithm else None,
        max_running_requests=4,
        max_total_tokens=1024,
        context_length=128,
    )
    runner = ModelRunner(args, recording_platform(log))
    run = runner._run

    def logged(*a, **kw):
        log.append("forward")
        return run(*a, **kw)

    runner._run = logged
    kv = TableKV(runner.req_to_token_pool)
    decoder = create_decoder(args, DecoderHandles(runner, kv, _commit, [1], InlineWorker()))
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=64),
        SamplingParams(temperature=1.0, seed=5, max_new_tokens=64),
    ]
    reqs = []
    for i, p in enumerate(params):
        p.normalize()
        reqs.append(Req(f"r{i}", [5 + i, 17, 33, 81 + i, 2], p))
    rows = runner.req_to_token_pool.alloc(len(reqs))
    for r, row in zip(reqs, rows):
        r.req_pool_idx = row
    lens = [5] * len(reqs)
    _, loc = kv.alloc_running(reqs, 5)
    ids = [t for r in reqs for t in r.origin_input_ids]
    hidden = runner.forward(
        runner.build_forward_batch(ForwardMode.EXTEND, ids, rows, lens, lens, loc)
    )
    for r in reqs:
        r.kv_len = 5
    last = torch.tensor([4 + 5 * i for i in range(len(reqs))])
    decoder.sample_and_commit(reqs, runner.compute_logits(hidden[last]))
    decoder.after_prefill(reqs, [0] * len(reqs), lens, hidden, [True] * len(reqs), len(reqs))
    return decoder, reqs


@pytest.mark.parametrize("algorithm", [None, "MTP"], ids=["plain", "mtp"])
def test_finish_waits_on_its_own_copy_only(algorithm):
    log: list[str] = []
    decoder, reqs = _setup(algorithm, log)
    assert decoder.can_overlap(reqs)
    log.clear()
    steps = 4
    log.append("launch1")
    launched = [decoder.launch(reqs, None)]
    finishes = []
    for n in range(1, steps + 1):
        if n < steps:
            log.append(f"launch{n + 1}")
            launched.append(decoder.launch(reqs, launched[-1]))
            assert launched[-1] is not None
        mark = len(log)
        assert decoder.finish(launched[n - 1]) == reqs
        finishes.append(log[mark:])
    # finish(N) waited on N's event alone: no forward, no other event, no full sync
    assert finishes == [[f"wait{n}"] for n in range(1, steps + 1)], log
    at = {e: i for i, e in enumerate(log) if e != "forward"}
    forwards = [i for i, e in enumerate(log) if e == "forward"]
    for n in range(1, steps):
        # N's copy and event: after N's (verify) forward, before N+1's launch enqueues more
        assert any(at[f"launch{n}"] < i < at[f"copy{n}"] for i in forwards), log
        assert at[f"copy{n}"] < at[f"launch{n + 1}"], log
        # N+1's forward is enqueued before finish(N) waits: the device has work meanwhile
        assert any(at[f"launch{n + 1}"] < i < at[f"wait{n}"] for i in forwards), log
        if algorithm == "MTP":  # the MTP pass drafting N+1's d_1 runs after the copy
            assert any(at[f"copy{n}"] < i < at[f"launch{n + 1}"] for i in forwards), log

    # the serial loop, from the same prefill, commits the same tokens
    serial, serial_reqs = _setup(algorithm, [])
    for _ in range(steps):
        serial.step(serial_reqs)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in serial_reqs]
