"""The graph runner with `--attention-backend triton` on CPU (kernels under Triton's interpreter,
graphs as eager replays over the static buffers): decode, both verify layouts (batch-expanded
rows, and one multi-query row per request) and the MTP draft forwards are captured once per
batch bucket over the whole KV width, and every replay equals the eager forward, at short and
long live KV lengths, with the KV split into parts planned from the static window. The
prompts' KV is random (no interpreted prefill), which keeps the module to seconds."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import ServerArgs
from srt_ascend.speculative.mtp_decoder import MTPDecoder
from tests.unit.test_graph_runner import K, Requests
from tests.unit.triton_interpreter import import_interpreted

import_interpreted()


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
