"""--enable-torch-compile: the graph runner's static-shape forwards compiled by torch.compile.

Each (kind, batch bucket, KV window) the graph runner captures, up to --torch-compile-max-bs,
is compiled whole (fullgraph, dynamic=False) with the platform's settings (`Platform.compile`)
and then captured like any forward: replayed by the C++ wrapper's code on CPU, inside a CUDA
graph on CUDA. Compiled artifacts go to the compile cache on disk, $TORCHINDUCTOR_CACHE_DIR,
by default ~/.cache/srt_ascend/inductor: on CPU each shape as an AOTInductor package, which a
later start loads while it captures the graphs, before serving, with no tracing or code
generation at all (compile_packages.py); elsewhere (or for a forward that cannot be packaged)
inductor's FX graph cache, so a restart skips inductor's code generation, autotuning and C++
builds but still traces each shape through dynamo and AOT autograd.

When shapes compile: with --torch-compile-at-start all of them before the server serves; by
default the server serves at once with every shape captured uncompiled, and the scheduler
compiles the queued shapes one at a time between steps once it has had no request for about
2 s (`Scheduler.run_forever`), in the order `CompileQueue` keeps: most-replayed shape first,
then smallest bucket, smallest KV window, the decoder's kind order. Each shape's compiled
graph replaces its uncompiled one in one dict assignment between two steps, so no step sees
a half-built shape. A request that arrives during a shape's compile waits for that one shape
(40-50 s cold on 2 CPU cores, about 5 s from a warm cache), then is served while the rest
wait for the next idle moment.

Why the scheduler thread and not a compile thread beside it (the rule; checked with torch
2.13 on CPU): torch.compile is not thread safe (dynamo and inductor share global state:
pytorch#105943, #118260, #136833, #168042), dynamo's config, where `allow_compiled_shapes`
raises the recompile limit, is per thread since torch 2.12 (#186537), and even a safe compile
would hold the GIL through tracing and lowering, so each of the ~2,500 ops of an eager step,
which releases the GIL, would wait up to the 5 ms switch interval to get it back; a second
thread running the compile's warm-up forwards and autotune benchmarks also brings a second
OpenMP team, which makes libgomp throttle the serving thread's spin-waits
(`start_scheduler_thread`). So every forward, compiled or not, runs in the scheduler thread.
A compile's forwards run over the static buffers zeroed first (`GraphRunner.compile_next`):
they write KV only into the reserved padding slot 0 and read no request's KV.

Which threads a compiled forward runs on (CPU): one fewer OpenMP thread than the process has
cores (`CpuPlatform.compiled_forward_threads`; eager forwards keep them all). Inductor's C++
code runs a decode forward as many small parallel regions (one per parallelized kernel), each
ending in a barrier that waits for every thread of the team; with a team on every core,
whatever else runs (the event loop streaming the last token, the tokenizer, the client, another
process) takes a core from a team thread, and each barrier then waits for it to be scheduled
again while its partner spins out its time slice. Measured on 2 shared cores
(benchmark/README.md, "Compiled forwards in the server"): the bare compiled decode forward took
12-20 ms with 2 threads and 3-7 ms with 1, and 19-69 ms against 3-12 ms beside one busy
process; served, its replay fell from 22.9 to 7.0 ms (median). Eager forwards run few, larger
parallel regions and lose far less. The count stays in force after a compiled forward for the
step's eager work until the next eager forward sets the eager count back (`CompiledForward`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "srt_ascend", "inductor")


def compile_max_bs(enabled: bool, max_bs: int, platform) -> int:
    """The largest batch bucket to compile: 0 (none) when compiling is off, or, with one
    warning line, when the platform cannot compile here (then every forward runs uncompiled)."""
    if not enabled:
        return 0
    why = platform.compile_unavailable()
    if why:
        logger.warning("--enable-torch-compile: %s; running the forwards uncompiled", why)
        return 0
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", DEFAULT_CACHE_DIR)
    torch._inductor.config.fx_graph_cache = True
    return max_bs


_compiled_shapes = 0  # dynamo compilations of the capture body in this process so far


def allow_compiled_shapes(n: int) -> None:
    """Every compiled shape is the same Python function (the graph runner's capture body)
    under other closures, and dynamo keeps at most `recompile_limit` compilations per function
    before it falls back to eager (a hard error with fullgraph): raise the limit by `n`
    compilations about to happen, counting earlier ones in this process (earlier shapes,
    earlier runners: a second Engine, a test session), whose entries stay in the function's
    cache. Called right before each dynamo compilation of the body, in the thread that runs
    it (dynamo's config is per thread): a shape compiled into a package is traced once (the
    package's recording backend), one that then cannot be packaged once more by its
    torch.compile fallback, and a loaded package not at all."""
    global _compiled_shapes
    _compiled_shapes += n
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _compiled_shapes)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, _compiled_shapes)


def set_intra_op_threads(n: int | None) -> None:
    """torch's intra-op (OpenMP) threads of this thread set to `n` (None: unchanged). The
    count stays until set again: a forward sets the count it runs with, and the eager work
    after it (a step's argmax, sampling) runs with that count too (`CompiledForward`)."""
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)


class CompiledForward:
    """`fn` compiled by `platform`, called outside inference mode (inductor cannot trace the
    in-place KV writes of a graph that runs under it) and without autograd, with the intra-op
    threads the platform gives compiled forwards (`Platform.compiled_forward_threads` of
    `eager_threads`, the count eager forwards run with): inductor's C++ kernels are generated
    for the count in force at the first call (the compile), and every call runs with that
    same count, for its own kernels and the oneDNN/MKL ones inside the graph alike.

    The count is left in force after a call (not set back): the step's eager work after a
    compiled forward (argmax, sampling, the host read) then runs on the same team, instead of
    waking a thread that the compiled forward left idle on a core that something else now
    holds (measured: a greedy argmax over 16 x 8192 logits took 6.7 ms a step that way, on 2
    shared cores). Eager forwards set the eager count back (`ModelRunner`, `GraphRunner`)."""

    def __init__(
        self,
        platform,
        fn: Callable[[], torch.Tensor],
        eager_threads: int,
        compiled: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        # `compiled`: `fn` compiled already (a loaded package: compile_packages.py)
        self._fn = compiled if compiled is not None else platform.compile(fn)
        self.threads = platform.compiled_forward_threads(eager_threads)

    def __call__(self) -> torch.Tensor:
        set_intra_op_threads(self.threads)
        with torch.inference_mode(False), torch.no_grad():
            return self._fn()


Shape = tuple[str, int, int]  # (kind name, batch bucket, KV window) of a captured graph


class CompileQueue:
    """The shapes still to compile and the order to compile them in: the shape served steps
    replayed most (uncompiled) first, then the smallest bucket, the smallest KV window, and
    the kind that comes first in `kind_order` (the decoder's: decode, verify, draft). Shows
    a tqdm bar on stderr; `progress` is what /server_info reports."""

    def __init__(self, shapes: Sequence[Shape], kind_order: Sequence[str]) -> None:
        rank = {name: i for i, name in enumerate(kind_order)}
        self._order = {s: (s[1], s[2], rank[s[0]]) for s in shapes}
        self._hits: Counter[Shape] = Counter()
        self.total, self.compiled, self.loaded = len(shapes), 0, 0
        self._bar = tqdm(total=self.total, desc="torch.compile", disable=not shapes)

    def __len__(self) -> int:
        return len(self._order)

    def hit(self, shape: Shape) -> None:
        """A step replayed `shape` uncompiled: it moves ahead of the shapes hit less."""
        if shape in self._order:
            self._hits[shape] += 1

    def pop(self) -> Shape:
        """Takes the next shape to compile off the queue (which must not be empty)."""
        shape = min(self._order, key=lambda s: (-self._hits[s], self._order[s]))
        del self._order[shape]
        return shape

    def loaded_from_cache(self, shape: Shape) -> None:
        """`shape` was loaded compiled from the compile cache: off the queue, compiled."""
        del self._order[shape]
        self.loaded += 1
        self.done(True)

    def done(self, compiled: bool) -> None:
        """The shape last popped is finished with: `compiled`, or it failed (it then keeps
        its uncompiled graph)."""
        self.compiled += compiled
        self._bar.update()
        if not self._order:
            self._bar.close()

    def progress(self) -> dict[str, int | bool]:
        """Shapes compiled so far, of `total` (`loaded` of them from the compile cache's
        packages); `ready` once none is left to try (a shape whose compile failed stays
        uncompiled and is not counted)."""
        return {
            "compiled": self.compiled,
            "loaded": self.loaded,
            "total": self.total,
            "ready": not self._order,
        }
