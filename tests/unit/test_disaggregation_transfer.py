"""Prefill-decode disaggregation's parts that need no server: the slot-run plan of a KV
transfer, the bootstrap fields' checks, the transfer-metrics counters, and Mooncake's
transfer engine (TCP, P2P handshake) moving an MLA KV pool's rows between two processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue

import pytest
import torch

from srt_ascend.disaggregation.protocol import BootstrapError, BootstrapInfo, KVDestination
from srt_ascend.disaggregation.transfer import (
    KVTransfer,
    TransferError,
    TransferQueue,
    slot_runs,
    write_plan,
)
from srt_ascend.mem_cache.memory_pool import MLATokenToKVPool
from srt_ascend.metrics import ServerMetrics


def test_slot_runs_join_positions_whose_slots_both_go_up_by_one():
    assert slot_runs([5, 6, 7, 9, 10, 3], [100, 101, 102, 103, 104, 50]) == [
        (5, 100, 3),
        (9, 103, 2),  # the source jumps: a new run although the destination goes on
        (3, 50, 1),
    ]
    assert slot_runs([], []) == []


def test_write_plan_one_write_per_run_and_buffer():
    srcs, dsts, lens = write_plan([(2, 10, 3), (7, 20, 1)], [1000, 5000], [9000, 20000], [8, 4])
    assert srcs == [1016, 1056, 5008, 5028]
    assert dsts == [9080, 9160, 20040, 20080]
    assert lens == [24, 8, 12, 4]


def test_bootstrap_fields():
    assert BootstrapInfo.from_fields(None, None, None) is None
    assert BootstrapInfo.from_fields("h", 8998, 7) == BootstrapInfo("h", 8998, 7)
    for fields, message in (
        (("h", 8998, None), "bootstrap_room must be an integer"),
        ((None, 8998, 7), "bootstrap_host"),
        (("h", "8998", 7), "bootstrap_port must be an integer"),
        (("h", 0, 7), "bootstrap_port must be in"),
        (("h", 8998, True), "bootstrap_room must be an integer"),
    ):
        with pytest.raises(BootstrapError, match=message):
            BootstrapInfo.from_fields(*fields)


def test_bootstrap_fields_per_generation():
    """One room per generation, spread as sglang-router sends them: one room for n samples
    (room + i, SGLang's rule), one per prompt (room[i] + j), one per generation."""
    per = BootstrapInfo.per_generation
    assert per(None, None, None, 2, 3) is None
    assert [b.room for b in per("h", 1, 10, 1, 3)] == [10, 11, 12]
    assert [b.room for b in per(["h", "h"], [1, 1], [10, 20], 2, 2)] == [10, 11, 20, 21]
    infos = per(["h", "g"], [1, 2], [10, 20], 1, 2)  # chat with n = 2: one per choice
    assert infos == [BootstrapInfo("h", 1, 10), BootstrapInfo("g", 2, 20)]
    assert per("h", 1, 7, 1, 1) == [BootstrapInfo("h", 1, 7)]
    for fields, message in (
        (("h", 1, [1, 2, 3], 1, 2), "bootstrap_room has 3 entries"),
        (("h", 1, [5, 5], 1, 2), "distinct bootstrap_rooms"),
        (("h", 1, [5, 6], 2, 2), "distinct bootstrap_rooms"),  # 5, 6, 6, 7
        (("h", 1, "x", 1, 2), "bootstrap_room must be an integer"),
        (("h", None, 3, 1, 2), "bootstrap_port must be an integer"),
    ):
        with pytest.raises(BootstrapError, match=message):
            per(*fields)


def test_destination_checks_its_fields():
    good = dict(
        room=1, session="h:1", prompt_len=2, digest="d", slots=[3, 4], buffers=[10],
        row_bytes=[8], num_main=1,
    )  # fmt: skip
    assert KVDestination.from_json(good).slots == [3, 4]
    for bad in ({**good, "slots": [3]}, {**good, "room": -1}, {**good, "extra": 1}, [1]):
        with pytest.raises(ValueError):
            KVDestination.from_json(bad)


def test_destination_of_a_tensor_parallel_decode_server_names_every_rank():
    good = dict(
        room=1, session="h:1", prompt_len=1, digest="d", slots=[3], buffers=[10, 20],
        row_bytes=[8, 8], num_main=2, hidden_addr=5, hidden_bytes=4, probs_addr=6,
        probs_bytes=4,
    )  # fmt: skip
    peer = {"session": "h:2", "buffers": [30, 40], "hidden_addr": 7, "probs_addr": 8}
    dest = KVDestination.from_json({**good, "peers": [peer]})
    assert dest.targets() == [("h:1", [10, 20], 5, 6), ("h:2", [30, 40], 7, 8)]
    assert KVDestination.from_json(good).targets() == [("h:1", [10, 20], 5, 6)]
    for bad in (
        {**peer, "buffers": [30]},  # a pool of another shape
        {**peer, "hidden_addr": 0},  # MTP on one rank only
        {**peer, "session": 1},
        {**peer, "extra": 1},
        {**peer, "buffers": 30},
        {**peer, "probs_addr": -1},
    ):
        with pytest.raises(ValueError, match="bad registration"):
            KVDestination.from_json({**good, "peers": [bad]})


def test_transfer_counters_in_metrics():
    m = ServerMetrics("tiny")
    state = {
        "num_running_reqs": 0,
        "num_queue_reqs": 0,
        "cache_hit_rate": 0.0,
        "max_total_num_tokens": 8,
        "available_kv_tokens": 8,
    }
    m.render({**state, "kv_transfer_bytes": 100, "kv_transfer_failures": 1})
    text = m.render({**state, "kv_transfer_bytes": 250, "kv_transfer_failures": 1}).decode()
    assert 'sglang:kv_transfer_bytes_total{model_name="tiny"} 250.0' in text
    assert 'sglang:kv_transfer_failures_total{model_name="tiny"} 1.0' in text
    assert 'sglang:kv_transfer_seconds_total{model_name="tiny"} 0.0' in text


def _pool() -> MLATokenToKVPool:
    return MLATokenToKVPool(32, 1, torch.float32, 8, 4, 3, layout="separate")


def _receiver(conn) -> None:
    """A decode side: a pool registered with its own engine; reports its buffers, waits,
    then sends back the rows written into it."""
    pool = _pool()
    engine = KVTransfer("127.0.0.1", None)
    engine.register(pool.transfer_buffers())
    conn.send((engine.session_id, [b.data_ptr() for b in pool.transfer_buffers()]))
    conn.recv()
    conn.send([b.numpy().copy() for b in pool.transfer_buffers()])  # by value


@contextlib.contextmanager
def _decode_side():
    """A `_receiver` process (forked before this process starts an engine of its own): yields
    the pipe to it and its (session, buffer addresses)."""
    here, there = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_receiver, args=(there,))
    child.start()
    try:
        yield here, here.recv()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_engine_writes_pool_rows_into_another_process():
    with _decode_side() as (here, (session, dst_buffers)):
        pool = _pool()
        for i, buf in enumerate(pool.transfer_buffers()):
            buf.copy_(torch.randn_like(buf) + i)
        engine = KVTransfer("127.0.0.1", None)
        engine.register(pool.transfer_buffers())
        src_slots, dst_slots = [1, 2, 3, 9], [20, 21, 22, 5]
        bufs = pool.transfer_buffers()
        rows = [b.stride(0) * b.element_size() for b in bufs]
        runs = slot_runs(src_slots, dst_slots)
        engine.write(session, *write_plan(runs, [b.data_ptr() for b in bufs], dst_buffers, rows))
        assert engine.stats.bytes == sum(rows) * 4 and engine.stats.writes == len(bufs) * 2
        here.send("done")
        got = here.recv()
        for mine, theirs in zip(bufs, map(torch.from_numpy, got)):
            assert torch.equal(theirs[dst_slots], mine[src_slots])
            assert not theirs[[0, 4, 6]].any()  # nothing else written
        with pytest.raises(TransferError):  # a peer that is not there
            engine.write("127.0.0.1:1", [bufs[0].data_ptr()], [dst_buffers[0]], [rows[0]])
        assert engine.stats.failures == 1


def test_transfer_queue_runs_a_lanes_jobs_in_order_and_reports_each():
    """Off the caller's thread: each job's batches written in order, `done(key, error)`
    after each (None, or the engine's failure), jobs of a lane in the order put."""
    with _decode_side() as (here, (session, dst_buffers)):
        pool = _pool()
        bufs = pool.transfer_buffers()
        for buf in bufs:
            buf.copy_(torch.randn_like(buf))
        engine = KVTransfer("127.0.0.1", None)
        engine.register(bufs)
        rows = [b.stride(0) * b.element_size() for b in bufs]
        src = [b.data_ptr() for b in bufs]
        ended: queue.Queue = queue.Queue()
        q = TransferQueue(engine, lambda key, error: ended.put((key, error)))
        good = (session, *write_plan([(1, 7, 2)], src, dst_buffers, rows))
        bad = ("127.0.0.1:1", src[:1], dst_buffers[:1], rows[:1])  # no peer there
        q.put(session, "first", [good])
        q.put(session, "second", [good, bad])  # the first batch lands, the job fails
        got = [ended.get(timeout=60) for _ in range(2)]
        assert got[0] == ("first", None)
        assert got[1][0] == "second" and "failed" in got[1][1]
        here.send("done")
        theirs = [torch.from_numpy(a) for a in here.recv()]
        for mine, t in zip(bufs, theirs):
            assert torch.equal(t[7:9], mine[1:3])
        assert engine.stats.failures == 1


def test_flags_parse_and_refuse_what_cannot_run(capsys):
    from srt_ascend.server_args import prepare_server_args

    args = prepare_server_args(["--disaggregation-mode", "prefill"])
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("prefill", 8998)
    assert args.disaggregated and args.disaggregation_ib_device is None
    assert not prepare_server_args([]).disaggregated
    # a decode server's ranks each take the whole latent KV
    assert prepare_server_args(["--disaggregation-mode", "decode", "--tp-size", "2"]).tp_size == 2
    for argv, message in (
        (["--disaggregation-mode", "both"], "invalid choice"),
        (["--disaggregation-transfer-backend", "nixl"], "not available here (accepted: mooncake)"),
        (["--disaggregation-bootstrap-port", "0"], "--disaggregation-bootstrap-port must be"),
        (
            ["--disaggregation-mode", "decode", "--tp-size", "2", "--enable-dp-attention"]
            + ["--dp-size", "2"],
            "cannot be combined with --enable-dp-attention",
        ),
        (["--disaggregation-timeout", "0"], "--disaggregation-timeout must be > 0"),
    ):
        with pytest.raises(SystemExit) as e:
            prepare_server_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
