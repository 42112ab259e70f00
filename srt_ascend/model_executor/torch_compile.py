"""--enable-torch-compile: the graph runner's static-shape forwards compiled by torch.compile.

Each (kind, batch bucket, KV window) the graph runner captures, up to --torch-compile-max-bs,
is compiled whole (fullgraph, dynamic=False) with the platform's settings (`Platform.compile`)
and then captured like any forward: replayed by the C++ wrapper's code on CPU, inside a CUDA
graph on CUDA. Compiled artifacts go to inductor's FX graph cache on disk,
$TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/srt_ascend/inductor, so a restart with the same
model and shapes skips inductor's code generation, autotuning and C++ builds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

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


_compiled_shapes = 0  # compilations of the capture body asked for in this process so far


def allow_compiled_shapes(n: int) -> None:
    """Every compiled shape is the same Python function (the graph runner's capture body)
    under other closures, and dynamo keeps at most `recompile_limit` compilations per function
    before it falls back to eager (a hard error with fullgraph): raise the limit to the number
    of shapes compiled in this process, counting earlier runners' (a second Engine, a test
    session), whose entries stay in the function's cache."""
    global _compiled_shapes
    _compiled_shapes += n
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _compiled_shapes)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, _compiled_shapes)


class CompiledForward:
    """`fn` compiled by `platform`, called outside inference mode (inductor cannot trace the
    in-place KV writes of a graph that runs under it) and without autograd."""

    def __init__(self, platform, fn: Callable[[], torch.Tensor]) -> None:
        self._fn = platform.compile(fn)

    def __call__(self) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():
            return self._fn()
