"""--enable-torch-compile without inductor's cost: the graph runner's forwards go through
torch.compile(fullgraph=True, dynamic=False) with dynamo's eager backend (tracing only), so a
graph break anywhere in a decode, verify (both layouts) or MTP draft forward fails here, and
a replay that recompiled (a guard on per-step host values such as FIA's lengths) is counted.
The compiled code itself (inductor) is checked end to end in
tests/engine/test_compile_lossless.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_graph_runner import Requests, make_runner

from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.model_executor.torch_compile import compile_max_bs
from srt_ascend.platforms import EagerReplayGraph
from srt_ascend.platforms.cpu import CpuPlatform
from srt_ascend.platforms.npu import NpuPlatform


class TracingPlatform(CpuPlatform):
    """The CPU platform compiling with dynamo's eager backend, counting compilations."""

    def __init__(self) -> None:
        self.compiles = 0

    def compile(self, fn):
        def count(gm, example_inputs):
            self.compiles += 1
            return gm.forward

        return torch.compile(fn, fullgraph=True, dynamic=False, backend=count)


def compiled_runner(path: str, verify: str, platform: TracingPlatform) -> ModelRunner:
    return make_runner(
        path, verify, platform=platform, enable_torch_compile=True, torch_compile_max_bs=2
    )


@pytest.mark.parametrize("verify", ["expand", "fia"])
def test_every_kind_compiles_whole_and_replays_without_recompiling(tiny_mtp_factory, verify):
    platform = TracingPlatform()
    runner = compiled_runner(tiny_mtp_factory(num_mtp=2).path, verify, platform)
    gr = runner.graph_runner
    kinds = {"decode", f"verify_{verify}", "draft_extend", "draft_step1"}
    assert set(gr.kinds) == kinds
    assert platform.compiles == len(kinds)  # bucket 2 of each kind; bucket 4 uncompiled
    for lens in ((5, 11), (9, 3), (7,)):  # bucket 2 (compiled) twice, then padded from 1
        reqs = Requests(runner, lens=lens)
        try:
            for prefix, layer, q_lens in (
                ("decode", None, None),
                (f"verify_{verify}", None, None),
                (f"verify_{verify}", None, [1] * len(lens)),  # FIA: requests without drafts
                ("draft_extend", 0, None),
                ("draft_step", 1, None),
            ):
                fb = reqs.batch(prefix, q_lens if verify == "fia" else None)
                hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
                hidden = hidden if layer is not None else None
                replayed = gr.replay(fb, reqs.kind(prefix), hidden)
                eager = runner.forward_eager(fb, layer, hidden)
                torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-5)
        finally:
            for s in reqs.slots:
                runner.allocator.free(s)
            runner.req_to_token_pool.free(reqs.rows)
    assert platform.compiles == len(kinds), "a replay recompiled"


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
