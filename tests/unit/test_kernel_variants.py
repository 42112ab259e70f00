"""Nothing compiles after the server says ready: every kernel variant serving launches is one
that `kernel_warmup.warm_up_kernels` launched at start.

The kernels run under Triton's interpreter; each launch is recorded by the key the CUDA JIT
would cache its compiled variant under (its launch constants and the specialisation of its
arguments: dtypes, the value 1, divisibility by 16, pointer alignment), computed with the
CUDA backend's own binder. After the warm-up, serving - prefills of random lengths over
cached prefixes (radix hits), chunks, eager decodes and verifies of random batches, graph
capture, MTP decoder steps greedy and sampled (seeded and not) - adds no key."""

from __future__ import annotations

import random

import pytest
import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.layers.ops import kv_cache, spec_accept
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.kernel_warmup import warm_up_kernels, warm_up_runs
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs
from srt_ascend.speculative.mtp_decoder import MTPDecoder
from tests.unit.test_graph_runner import K
from tests.unit.test_graph_runner_triton import _serve
from tests.unit.triton_interpreter import import_interpreted

attn_triton, kv_triton, accept_triton, _ = import_interpreted()
# The ops' dispatch tables, and the Triton function each serves CUDA tensors with: for this
# module CPU tensors take them too (interpreted), as CUDA tensors would.
AS_ON_CUDA = [
    (kv_cache._STORE_IMPLS, kv_triton.store_kv),
    (kv_cache._ASSIGN_IMPLS, kv_triton.assign_req_to_token),
    (spec_accept._GREEDY_IMPLS, accept_triton.greedy_accept),
    (spec_accept._REJECTION_IMPLS, accept_triton.rejection_sample),
]
EXTEND = ForwardMode.EXTEND


class VariantRecorder:
    """Records (kernel, CUDA cache key) for every interpreted launch while installed."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders: dict = {}
        self.keys: set[tuple[str, str]] = set()

    def key(self, interpreted, args, kwargs) -> tuple[str, str]:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        binder = self.binders.get(interpreted.fn)
        if binder is None:
            flags = interpreted.rewriter.kwargs  # what triton.jit was given
            jit = JITFunction(
                interpreted.fn,
                do_not_specialize=flags.get("do_not_specialize"),
                do_not_specialize_on_alignment=flags.get("do_not_specialize_on_alignment"),
            )
            binder = create_function_from_signature(jit.signature, jit.params, self.backend)
            self.binders[interpreted.fn] = binder
        _, specialization, options = binder(*args, **kwargs)
        return interpreted.__name__, str(specialization) + str(options)

    def install(self):
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.__getitem__
        recorder = self

        def getitem(self, grid):
            launch = original(self, grid)

            def run(*args, **kwargs):
                recorder.keys.add(recorder.key(self, args, kwargs))
                return launch(*args, **kwargs)

            return run

        InterpretedFunction.__getitem__ = getitem
        return lambda: setattr(InterpretedFunction, "__getitem__", original)


@pytest.fixture(scope="module")
def served(tiny_mtp_factory):
    """(keys the warm-up launched, keys serving launched after it)."""
    for table, fn in AS_ON_CUDA:
        table["cpu"] = lambda fn=fn: fn
    try:
        yield _warm_then_serve(tiny_mtp_factory)
    finally:
        for table, _ in AS_ON_CUDA:
            del table["cpu"]


def _warm_then_serve(tiny_mtp_factory):
    args = ServerArgs(
        model_path=tiny_mtp_factory(num_mtp=1, num_hidden_layers=2).path,
        dtype="float32",
        context_length=480,  # > 256 keys: a lone row's KV splits into parts
        max_running_requests=4,
        max_total_tokens=2048,
        speculative_algorithm="MTP",
        speculative_num_steps=K,
        speculative_verify="expand",
        attention_backend="triton",
        enable_cpu_graph=True,
        cuda_graph_bs=(2,),
    )
    runner = ModelRunner(args, get_platform("cpu"))
    pool = runner.req_to_token_pool
    pool.host = pool.req_to_token.clone()  # as on CUDA: writes reach the table by a kernel
    recorder = VariantRecorder()
    uninstall = recorder.install()
    try:
        assert warm_up_kernels(runner, progress=False) == len(warm_up_runs(runner))
        warm = set(recorder.keys)
        recorder.keys.clear()
        decoder = MTPDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
        multi_query = GraphKind(
            "verify_multi_query", ForwardMode.TARGET_VERIFY, K + 1, 1, runner.attn_backend
        )
        runner.capture_graphs([*decoder.graph_kinds(), multi_query])
        _random_forwards(runner, random.Random(0))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
        seeded = SamplingParams(temperature=1.0, seed=7, max_new_tokens=64)
        unseeded = SamplingParams(temperature=1.0, max_new_tokens=64)
        _serve(runner, [greedy, seeded], steps=2)
        _serve(runner, [unseeded], steps=2)
        return warm, set(recorder.keys)
    finally:
        uninstall()


def eager_forwards(runner: ModelRunner, plans, n_rows: int, length: int) -> None:
    """Eager forwards through `runner` over `n_rows` request rows of `length` KV slots each:
    for each (mode, query lengths q, KV lengths seq) of `plans`, a batch of the first len(q)
    rows with random ids, its logits (asserted finite), then the MTP draft extend after it.
    The rows and slots are freed after."""
    pool, alloc = runner.req_to_token_pool, runner.allocator
    rows = pool.alloc(n_rows)
    slots = [alloc.alloc(length) for _ in rows]
    try:
        for row, s in zip(rows, slots):
            pool.write([row], [0], s, [length])
        for mode, q, seq in plans:
            b = len(q)
            loc = torch.cat([s[n - m : n] for s, n, m in zip(slots, seq, q)])
            ids = torch.randint(3, runner.vocab_size, (sum(q),))
            fb = runner.build_forward_batch(mode, ids, rows[:b], seq, q, loc)
            hidden = runner.forward_eager(fb)
            assert torch.isfinite(runner.compute_logits(hidden)).all()
            draft = runner.build_forward_batch(ForwardMode.DRAFT_EXTEND, ids, rows[:b], seq, q, loc)
            runner.forward_eager(draft, 0, hidden)
    finally:
        for s in slots:
            alloc.free(s)
        pool.free(rows)


def _random_forwards(runner: ModelRunner, rng: random.Random) -> None:
    """Eager forwards of random shapes: prefills over random cached prefixes (a radix hit
    or an earlier chunk), decodes and verifies of random batches, MTP draft extends."""

    def plans():
        for _ in range(6):
            batch = rng.randint(1, 3)
            mode = rng.choice([EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
            q = [1 if mode == ForwardMode.DECODE else rng.randint(1, 40) for _ in range(batch)]
            if mode == ForwardMode.TARGET_VERIFY:
                q = [K + 1] * batch
            yield mode, q, [rng.randint(n, 460) for n in q]

    eager_forwards(runner, plans(), 3, 470)


def test_serving_launches_only_warmed_variants(served):
    warm, serving = served
    kernels = {name for name, _ in warm}
    assert {"_mla_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel"} <= kernels
    assert {"_assign_kernel", "_greedy_kernel", "_rejection_kernel"} <= kernels
    assert serving, "nothing was served"
    new = serving - warm
    assert not new, f"variants first launched while serving: {sorted(new)}"


def test_every_query_length_picks_a_warmed_tile():
    """Host side, any length: the tile height of a launch is one the warm-up's query lengths
    give (the rest of the variant - KV parts, query blocks, rows - is plain arguments)."""
    for heads in (1, 4, 8, 16, 128):
        for fixed in (False, True):
            for rows in attn_triton.TILE_ROWS:  # every GPU's and dtype's tile
                warmed = {
                    attn_triton.tile_shape(heads, q, fixed, rows)
                    for q in attn_triton.q_len_buckets(heads, fixed)
                }
                for q in range(1, 9000, 7):
                    shape = attn_triton.tile_shape(heads, q, fixed, rows)
                    assert shape in warmed, (heads, q, rows)


def test_start_warms_kernels_where_they_compile(monkeypatch):
    """The scheduler's one call before ready (`capture_graphs`) runs the warm-up where
    kernels compile at first launch (CUDA, NPU), graphs on or off; not on CPU."""
    from srt_ascend.model_executor import model_runner as model_runner_module
    from srt_ascend.server_args import SHIPPED_MODEL

    calls = []
    monkeypatch.setattr(model_runner_module, "warm_up_kernels", calls.append)
    cpu = type(get_platform("cpu"))

    class Compiling(cpu):
        compiles_kernels = True

    args = ServerArgs(model_path=SHIPPED_MODEL, dtype="float32", context_length=64)
    for platform, warmed in ((get_platform("cpu"), 0), (Compiling(), 1)):
        runner = ModelRunner(args, platform)
        runner.capture_graphs([])
        assert len(calls) == warmed
    assert calls == [runner]
    assert get_platform("cpu").compiles_kernels is False
    from srt_ascend.platforms.cuda import CudaPlatform

    assert CudaPlatform.compiles_kernels is True
