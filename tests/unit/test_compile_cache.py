"""A warm start generates and builds no code (--enable-torch-compile, CPU, the platform's real
inductor settings): a second model runner started against the same compile cache (and with
dynamo's in-memory code emptied, as in a new process) finds every shape's compiled code in
inductor's FX graph cache; none misses. AOT autograd's own cache, which would also skip AOT
autograd's tracing (most of a warm shape's seconds), is bypassed while weights are frozen
(inductor's `freezing`); with freezing off it hit, but a warm hit across processes failed in
the server (benchmark/README.md, "Warm start"), so freezing stays and this pins the bypass.
"""

from __future__ import annotations

from collections import Counter

from srt_ascend.decoding import DecoderHandles
from srt_ascend.decoding.plain import PlainDecoder
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.cpu import CpuPlatform
from srt_ascend.server_args import ServerArgs

WATCHED = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}


def start(path: str) -> tuple[ModelRunner, Counter]:
    """A runner compiling the plain decoder's shapes at start (bucket 1, one KV window), and
    what the compile caches counted meanwhile. Dynamo's in-memory code cache is emptied
    first, as in a new process (in one process a second runner reuses the first's compiled
    code: same code, guards on tensor shapes and dtypes only)."""
    # imported here, not at collection (tests/unit/triton_interpreter.py)
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()

    before = Counter({(g, k): counters[g][k] for g, ks in WATCHED.items() for k in ks})
    args = ServerArgs(
        model_path=path,
        dtype="float32",
        context_length=40,  # a 57-wide row: one KV window
        max_running_requests=2,
        max_total_tokens=256,
        cuda_graph_bs=(1,),
        enable_torch_compile=True,
        torch_compile_max_bs=1,
        torch_compile_at_start=True,
    )
    runner = ModelRunner(args, CpuPlatform())
    decoder = PlainDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    runner.capture_graphs(decoder.graph_kinds())
    after = Counter({(g, k): counters[g][k] for g, ks in WATCHED.items() for k in ks})
    after.subtract(before)
    return runner, +after


def test_a_second_start_with_the_same_cache_compiles_nothing(
    tiny_mtp_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = tiny_mtp_factory().path
    first, cold = start(path)
    shapes = first.graph_runner.compile_queue.compiled
    assert shapes == 1, first.graph_runner.graphs
    assert cold == {
        ("inductor", "fxgraph_cache_miss"): 1,
        ("aot_autograd", "autograd_cache_bypass"): 1,
    }
    _, warm = start(path)
    assert warm == {
        ("inductor", "fxgraph_cache_hit"): 1,
        ("aot_autograd", "autograd_cache_bypass"): 1,
    }
