"""The graph runner with `--attention-backend triton` on CPU (kernels under Triton's interpreter,
graphs as eager replays over the static buffers): decode, both verify layouts (batch-expanded
rows, and one multi-query row per request) and the MTP draft forwards are captured once per
batch bucket over the whole KV width, and every replay equals the eager forward, at short and
long live KV lengths, with the KV split into parts planned from the static window. The
prompts' KV is random (no interpreted prefill), which keeps the module to seconds. Serving's
MTP steps then run through the graphs with the KV store, request-table and acceptance ops
dispatched to their (interpreted) Triton kernels, as on CUDA."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.layers.ops import kv_cache, spec_accept
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.mem_cache.memory_pool import ReqToTokenPool
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs
from srt_ascend.speculative.mtp_decoder import MTPDecoder
from tests.unit.test_device_discipline import TableKV, _commit
from tests.unit.test_graph_runner import K, Requests
from tests.unit.triton_interpreter import import_interpreted

_, kv_triton, accept_triton, _ = import_interpreted()
EXTEND = ForwardMode.EXTEND


@pytest.fixture(scope="module")
def runner(tiny_mtp_factory) -> ModelRunner:
    args = ServerArgs(
        # one dense and one MoE layer, one MTP layer: few interpreted launches per forward
        model_path=tiny_mtp_factory(num_mtp=1, num_hidden_layers=2).path,
        dtype="float32",
        context_length=480,  # a 497-wide KV window: the kernel splits it into 2 parts
        max_running_requests=2,
        max_total_tokens=1024,
        speculative_algorithm="MTP",
        speculative_num_steps=K,
        speculative_verify="expand",
        attention_backend="triton",
        enable_cpu_graph=True,
        cuda_graph_bs=(2,),
    )
    runner = ModelRunner(args, get_platform("cpu"))
    decoder = MTPDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    # The multi-query verify layout (FIA's rows) through the triton kernel.
    multi_query = GraphKind(
        "verify_multi_query", ForwardMode.TARGET_VERIFY, K + 1, 1, runner.attn_backend
    )
    kinds = [*decoder.graph_kinds(), multi_query]
    runner.capture_graphs(kinds)
    runner.kinds = {kind.name: kind for kind in kinds}
    return runner


def test_one_graph_per_bucket_serves_every_kv_length(runner):
    gr = runner.graph_runner
    assert type(runner.attn_backend).__name__ == "TritonMLABackend"
    assert set(gr.kinds) == {
        "decode", "verify_expand", "verify_multi_query", "draft_extend", "draft_step0"
    }  # fmt: skip
    assert gr.graphs_per_kind() == {name: 1 for name in gr.kinds}  # one bucket: 2
    assert {window for _, _, window in gr.graphs} == {gr.static_kv_len}


KINDS = ["decode", "verify_expand", "verify_multi_query", "draft_extend", "draft_step"]


@pytest.mark.parametrize(
    ("length", "kinds"), [(150, KINDS), (9, ["decode"])], ids=["long-all-kinds", "short-decode"]
)
def test_triton_replay_matches_eager(runner, length, kinds):
    """One request in the bucket of 2 (a padding row beside it). At 150 positions its KV spans
    both parts the kernel splits the 497-wide window into, and the verify rows differ in
    length; the same decode graph then serves a 9-position request."""
    gr = runner.graph_runner
    reqs = Requests(runner, lens=(length,), cap=length + K + 1, prefill=False)
    try:
        for kind in kinds:
            fb = reqs.batch(kind)
            graph_kind = reqs.kind(kind)
            hidden = None
            if graph_kind.mtp_layer is not None:
                hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
            before = gr.replays[graph_kind.name]
            replayed = gr.replay(fb, graph_kind, hidden)
            assert gr.replays[graph_kind.name] == before + 1
            meta = gr.graphs[graph_kind.name, 2, gr.static_kv_len].fb.attn_metadata
            assert meta.max_kv_len == gr.static_kv_len  # KV parts planned from the window
            eager = runner.forward_eager(fb, graph_kind.mtp_layer, hidden)
            torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4, msg=kind)
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)


def _counted(calls: dict, name: str, fn):
    def loader():
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return run

    return loader


def _serve(runner, params: list[SamplingParams], steps: int) -> list[list[int]]:
    """Prefill (eager) and `steps` MTP decoder steps through the captured graphs; the tokens."""
    args = runner.server_args
    pool = runner.req_to_token_pool
    decoder = MTPDecoder(args, DecoderHandles(runner, TableKV(pool), _commit, [1]))
    reqs = []
    for i, p in enumerate(params):
        p.normalize()
        reqs.append(Req(f"r{i}", [5 + i, 17, 33, 81 + i, 2], p))
    rows = pool.alloc(len(reqs))
    try:
        for r, row in zip(reqs, rows):
            r.req_pool_idx = row
        lens = [5] * len(reqs)
        _, loc = decoder.h.kv.alloc_running(reqs, 5)
        ids = [t for r in reqs for t in r.origin_input_ids]
        hidden = runner.forward(runner.build_forward_batch(EXTEND, ids, rows, lens, lens, loc))
        for r in reqs:
            r.kv_len = 5
        last = torch.tensor([4 + 5 * i for i in range(len(reqs))])
        decoder.sample_and_commit(reqs, runner.compute_logits(hidden[last]))
        decoder.after_prefill(reqs, [0] * len(reqs), lens, hidden, [True] * len(reqs), 2)
        for _ in range(steps):
            decoder.step(reqs)
        return [list(r.output_ids) for r in reqs]
    finally:
        pool.free(rows)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_serving_runs_the_kernels_through_the_graphs(runner, monkeypatch, sampled):
    """MTP decoder steps through the captured graphs with the custom ops dispatched to their
    Triton kernels, as CUDA tensors are (here interpreted, for CPU tensors): the KV store in
    every captured forward and the chain acceptance (greedy; token-wise rejection sampling
    for a seeded sampled request) run their kernels, and the tokens equal those of the torch
    references' run."""
    params = lambda: [  # noqa: E731
        SamplingParams(temperature=0.0, max_new_tokens=64),
        SamplingParams(temperature=1.0, seed=3, max_new_tokens=64)
        if sampled
        else SamplingParams(temperature=0.0, max_new_tokens=64),
    ]
    replays = sum(runner.graph_runner.replays.values())
    want = _serve(runner, params(), 3)
    assert sum(runner.graph_runner.replays.values()) > replays  # the steps replayed graphs
    calls: dict[str, int] = {}
    rule = ("rejection", accept_triton.rejection_sample) if sampled else None
    rule = rule or ("greedy", accept_triton.greedy_accept)
    table = spec_accept._REJECTION_IMPLS if sampled else spec_accept._GREEDY_IMPLS
    monkeypatch.setitem(table, "cpu", _counted(calls, *rule))
    monkeypatch.setitem(
        kv_cache._STORE_IMPLS, "cpu", _counted(calls, "store_kv", kv_triton.store_kv)
    )
    assert _serve(runner, params(), 3) == want
    assert calls.get(rule[0], 0) >= 3 and calls.get("store_kv", 0) > 0, calls


def test_request_table_writes_run_the_assign_kernel(monkeypatch):
    """Where the request table lives on an accelerator (a host mirror beside it), its writes
    reach the device table through `assign_req_to_token`: the Triton kernel on CUDA."""
    calls: dict[str, int] = {}
    monkeypatch.setitem(
        kv_cache._ASSIGN_IMPLS, "cpu", _counted(calls, "assign", kv_triton.assign_req_to_token)
    )
    pool = ReqToTokenPool(4, 64)
    pool.host = pool.req_to_token.clone()  # as on an accelerator: a separate host copy
    pool.write([2, 0], [3, 0], torch.arange(100, 107), [4, 3])  # a prefill: ragged rows
    pool.write([2, 0], [7, 3], torch.tensor([7, 8]), [1, 1])  # a decode step
    assert calls == {"assign": 2}
    assert torch.equal(pool.req_to_token, pool.host)
    assert pool.host[2, 3:8].tolist() == [100, 101, 102, 103, 7]
    assert pool.host[0, :4].tolist() == [104, 105, 106, 8]
