"""--enable-torch-compile without inductor's cost: the graph runner's forwards go through
torch.compile(fullgraph=True, dynamic=False) with dynamo's eager backend (tracing only), so a
graph break anywhere in a decode, verify (both layouts) or MTP draft forward fails here, and
a replay that recompiled (a guard on per-step host values such as FIA's lengths) is counted.
Also the compile queue (serving at once, compiling while idle): its order, the swap of one
shape at a time, what a compile writes into the KV pool, and a scheduler that stops between
two shapes. The compiled code itself (inductor) is checked end to end in
tests/engine/test_compile_lossless.py."""

from __future__ import annotations

import importlib.util
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from test_graph_runner import Requests, make_runner

from srt_ascend.managers.io_struct import ServingStarted
from srt_ascend.managers.scheduler import start_scheduler_thread
from srt_ascend.managers.tp_ranks import build_scheduler
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.model_executor.torch_compile import CompileQueue, compile_max_bs
from srt_ascend.platforms import EagerReplayGraph
from srt_ascend.platforms.cpu import CpuPlatform
from srt_ascend.platforms.npu import NpuPlatform
from srt_ascend.server_args import ServerArgs


class TracingPlatform(CpuPlatform):
    """The CPU platform compiling with dynamo's eager backend, counting compilations and
    keeping each compiled graph's outputs' (shape, dtype) and the ops it calls (no
    AOTInductor packages: every shape goes through `compile`)."""

    package_options = None

    def __init__(self) -> None:
        self.compiles = 0
        self.outputs: list[list[tuple[tuple[int, ...], torch.dtype]]] = []
        self.ops: set[str] = set()

    def compile(self, fn):
        def count(gm, example_inputs):
            self.compiles += 1
            self.ops |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            outs = gm.graph.output_node().args[0]
            vals = [o.meta["example_value"] for o in outs]  # dynamo's fake outputs
            self.outputs.append([(tuple(v.shape), v.dtype) for v in vals])
            return gm.forward

        return torch.compile(fn, fullgraph=True, dynamic=False, backend=count)


def compiled_runner(
    path: str, verify: str, platform: TracingPlatform, at_start: bool = True
) -> ModelRunner:
    return make_runner(
        path,
        verify,
        platform=platform,
        enable_torch_compile=True,
        torch_compile_max_bs=2,
        torch_compile_at_start=at_start,
    )


@pytest.mark.parametrize("verify", ["expand", "fia"])
def test_every_kind_compiles_whole_and_replays_without_recompiling(tiny_mtp_factory, verify):
    platform = TracingPlatform()
    runner = compiled_runner(tiny_mtp_factory(num_mtp=2).path, verify, platform)
    gr = runner.graph_runner
    # the 2-layer checkpoint: layer 1's pass over committed positions has its own kind
    kinds = {"decode", f"verify_{verify}", "draft_extend", "draft_extend_l1", "draft_step1"}
    assert set(gr.kinds) == kinds
    assert platform.compiles == len(kinds)  # bucket 2 of each kind; bucket 4 uncompiled
    # the LM head is compiled into every kind's graph but layer 1's pass (its KV only)
    vocab = runner.vocab_size
    with_logits = [
        o for o in platform.outputs if (o[-1][0][-1], o[-1][1]) == (vocab, torch.float32)
    ]
    assert len(with_logits) == len(kinds) - 1, platform.outputs
    # off NPU the FIA verify's attention is tensor ops the compiler fuses, not the opaque
    # reference with its per-layer host planning (2.3-2.6x a compiled decode at one request)
    assert not [op for op in platform.ops if "fia_reference_mla" in op]
    for lens in ((5, 11), (9, 3), (7,)):  # bucket 2 (compiled) twice, then padded from 1
        reqs = Requests(runner, lens=lens)
        try:
            for prefix, layer, q_lens in (
                ("decode", None, None),
                (f"verify_{verify}", None, None),
                (f"verify_{verify}", None, [1] * len(lens)),  # FIA: requests without drafts
                ("draft_extend", 0, None),
                ("draft_extend_l1", 1, None),
                ("draft_step", 1, None),
            ):
                fb = reqs.batch(prefix, q_lens if verify == "fia" else None)
                hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
                hidden = hidden if layer is not None else None
                replayed, logits = gr.run(fb, reqs.kind(prefix), hidden)[:2]
                eager = runner.forward_eager(fb, layer, hidden)
                torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-5)
                if layer != 1:
                    want = runner.compute_logits(eager)
                    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        finally:
            for s in reqs.slots:
                runner.allocator.free(s)
            runner.req_to_token_pool.free(reqs.rows)
    assert platform.compiles == len(kinds), "a replay recompiled"


@pytest.mark.skipif(
    CpuPlatform().compiled_forward_threads(64) == 64, reason="one core: nothing to leave"
)
def test_compiled_replays_keep_their_thread_count_and_eager_forwards_take_every_core_back(
    tiny_mtp_factory,
):
    """A compiled replay runs with the compiled forwards' count and leaves it for the step's
    eager work after it (argmax, sampling); an eager forward, or a replay of an uncompiled
    graph (bucket 4 here), sets the eager count back."""
    before = torch.get_num_threads()
    try:
        runner = compiled_runner(tiny_mtp_factory(num_mtp=2).path, "fia", TracingPlatform())
        eager = runner.eager_threads
        compiled = runner.platform.compiled_forward_threads(eager)
        decode = None
        for lens, want in (((5, 11), compiled), ((5, 7, 9), eager), ((4,), compiled)):
            reqs = Requests(runner, lens=lens)
            try:
                fb = reqs.batch("decode")
                decode = reqs.kind("decode")
                runner.forward_logits(fb, decode)  # bucket 2 compiled, bucket 4 not
                assert torch.get_num_threads() == want, lens
                runner.forward_eager(reqs.batch("decode"))
                assert torch.get_num_threads() == eager
            finally:
                for s in reqs.slots:
                    runner.allocator.free(s)
                runner.req_to_token_pool.free(reqs.rows)
    finally:
        torch.set_num_threads(before)


def test_no_compiler_warns_once_and_runs_uncompiled(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr("shutil.which", lambda name: None)
    cpu = CpuPlatform()
    assert compile_max_bs(True, 8, cpu) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "--enable-torch-compile: no C++ compiler found (g++, clang++ or $CXX), which "
        "inductor needs on CPU; running the forwards uncompiled"
    ]
    assert compile_max_bs(False, 8, cpu) == 0


def test_npu_compiles_through_torchair_where_installed():
    npu = NpuPlatform()
    if importlib.util.find_spec("torchair") is None:
        assert "torchair" in npu.compile_unavailable()
    else:
        assert npu.compile_unavailable() is None
    assert isinstance(npu.new_graph(compiled=True), EagerReplayGraph)  # torchair's GE graph


def test_compile_queue_puts_hit_shapes_first_then_small_buckets_windows_and_kinds():
    shapes = [
        ("verify", 4, 64),
        ("decode", 4, 64),
        ("verify", 1, 128),
        ("decode", 1, 128),
        ("verify", 1, 64),
        ("decode", 1, 64),
    ]
    queue = CompileQueue(shapes, ["decode", "verify"])
    queue.hit(("verify", 4, 64))
    queue.hit(("verify", 4, 64))
    queue.hit(("decode", 1, 128))
    queue.hit(("decode", 9, 9))  # not queued (an uncompiled bucket): ignored
    order = []
    while queue:
        order.append(queue.pop())
        queue.done(compiled=order[-1] != ("decode", 4, 64))  # that one fails
    assert order == [
        ("verify", 4, 64),  # hit twice
        ("decode", 1, 128),  # hit once
        ("decode", 1, 64),  # then bucket, KV window, the kinds' order
        ("verify", 1, 64),
        ("verify", 1, 128),
        ("decode", 4, 64),
    ]
    assert queue.progress() == {"compiled": 5, "loaded": 0, "total": 6, "ready": True}


def kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    """Every KV slot but the padding one (slot 0), of every layer."""
    pool = runner.kv_pool
    return [
        t[1:].clone()
        for layer in range(runner.num_layers)
        for t in (pool.get_c_kv(layer), pool.get_k_pe(layer))
    ]


def test_deferred_compile_swaps_one_shape_at_a_time_without_touching_request_kv(
    tiny_mtp_factory,
):
    platform = TracingPlatform()
    runner = compiled_runner(tiny_mtp_factory().path, "fia", platform, at_start=False)
    gr = runner.graph_runner
    window = gr.static_kv_len
    assert platform.compiles == 0
    assert not any(g.compiled for g in gr.graphs.values())
    assert gr.compile_queue.progress() == {"compiled": 0, "loaded": 0, "total": 4, "ready": False}
    reqs = Requests(runner, lens=(5, 11))  # bucket 2: compiled, once its turn comes
    try:
        extend = reqs.kind("draft_extend")
        fb = reqs.batch("draft_extend")
        hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
        uncompiled = [gr.replay(fb, extend, hidden) for _ in range(2)][-1]
        gr.replay(reqs.batch("decode"), reqs.kind("decode"))  # its inputs stay in the buffers
        kv = kv_snapshot(runner)
        assert runner.compile_next_graph()
        assert platform.compiles == 1
        assert gr.graphs[extend.name, 2, window].compiled  # replayed most: compiled first
        for before, after in zip(kv, kv_snapshot(runner)):
            torch.testing.assert_close(after, before, rtol=0, atol=0)  # slot 0 only
        torch.testing.assert_close(gr.replay(fb, extend, hidden), uncompiled)
        assert gr.compiled_replays[extend.name] == 1
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)
    while runner.compile_next_graph():
        pass
    assert platform.compiles == 4
    assert all(g.compiled == (bs <= 2) for (_, bs, _), g in gr.graphs.items())
    assert gr.compile_queue.progress() == {"compiled": 4, "loaded": 0, "total": 4, "ready": True}


class BlockingPlatform(TracingPlatform):
    """Compiles hold in the backend until `release` is set; `compiling` says one started."""

    def __init__(self) -> None:
        super().__init__()
        self.compiling, self.release = threading.Event(), threading.Event()

    def compile(self, fn):
        def hold(gm, example_inputs):
            self.compiles += 1
            self.compiling.set()
            assert self.release.wait(60)
            return gm.forward

        return torch.compile(fn, fullgraph=True, dynamic=False, backend=hold)


NO_TOKENIZER = SimpleNamespace(eos_token_id=None)  # no request is decoded


def test_idle_scheduler_compiles_and_stops_between_shapes(tiny_mtp_factory):
    args = ServerArgs(
        model_path=tiny_mtp_factory().path,
        dtype="float32",
        context_length=48,
        max_running_requests=2,
        max_total_tokens=512,
        speculative_algorithm="MTP",
        enable_torch_compile=True,
        torch_compile_max_bs=2,
        cuda_graph_bs=(1, 2),
    )
    platform = BlockingPlatform()
    scheduler, thread = start_scheduler_thread(
        lambda: build_scheduler(args, platform, NO_TOKENIZER, lambda outputs: None)
    )
    try:
        scheduler.submit(ServingStarted())  # the server's ready: idle compiles may start
        assert platform.compiling.wait(60), "the idle scheduler did not start compiling"
        scheduler.stop()  # while a shape compiles
    finally:
        platform.release.set()
    start = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert time.monotonic() - start < 30
    progress = scheduler.runner.graph_runner.compile_queue.progress()
    # the rest never started
    assert progress == {"compiled": 1, "loaded": 0, "total": 6, "ready": False}
