"""Compiled forwards kept as AOTInductor packages (--enable-torch-compile on CPU).

A warm start with torch.compile alone still traces every shape through dynamo and AOT
autograd (inductor's FX graph cache only skips code generation): about 5-13 s a shape on 2
cores, and AOT autograd's own cache cannot help while weights are frozen. So each compiled
shape is also written as an AOTInductor package (`torch._inductor.aoti_compile_and_package`),
one file per shape under $TORCHINDUCTOR_CACHE_DIR/aoti/, and a later start with the same
package key loads it (`aoti_load_package`: a shared library, well under a second) with no
dynamo, AOT autograd or inductor work at all.

What a package holds, and what it does not:
- The graph dynamo captures from the capture body (`torch.compile` with a recording
  backend), exported (`torch.export`) and compiled by AOTInductor with the platform's
  options (`Platform.package_options`). Its inputs are the tensors the forward reads:
  weights, rotary caches, weight stacks, the KV pool, the static batch buffers. They are
  *not* stored: a package records each input's name, the path to it from the forward's
  state (`tensor_names`: `fb.token_to_kv_pool._joint.3`, `model.model.layers.0...`), and
  its size, stride, offset and dtype; loading resolves every name against this process's
  objects and checks those. Weights are inputs, not constants (no freezing), so a package
  does not depend on weight values, and replays read the live tensors (the KV writes land
  in the pool). Inputs that share a storage (a KV layer's joint buffer and its latent /
  rope views) are passed as one flat base and re-viewed inside the graph, so the graph sees
  no aliased inputs.
- The key (`package_key`): torch version, CPU capability, the srt_ascend sources, the
  checkpoint's config.json, every server argument that can change a forward, the kind,
  bucket and KV window, and the OpenMP threads the kernels are generated for. Weight files
  are not in it (weights are inputs).

Dynamo's other outputs (attention metadata the body stores on the batch) are dropped: only
the body's return values are kept (`user_outputs`); nothing reads that metadata after the
forward. A package that fails to load, names a tensor this process does not have, or
disagrees on any input's layout is stale or corrupt: it is removed, logged, and the shape
compiles afresh (and is packaged again). A shape that cannot be packaged at all (an input
the walk cannot name) compiles with torch.compile as before.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKAGE_DIR = "aoti"
FORMAT = 1  # bump when what a package records changes
_META = "srt_ascend"  # the package metadata key holding `PackageMeta` as JSON

# server arguments that never change a captured forward (everything else is in the key)
SERVING_ONLY_ARGS = frozenset(
    {
        "tokenizer_path",
        "served_model_name",
        "host",
        "port",
        "random_seed",
        "log_level",
        "api_key",
        "admin_api_key",
        "max_request_body_mb",
        "max_payload_size",
        "max_tokenize_tokens",
        "request_read_timeout",
        "max_queued_requests",
        "max_prompts_per_request",
        "shutdown_timeout",
        "schedule_policy",
        "stream_interval",
        "decode_log_interval",
        "enable_metrics",
        "enable_cache_report",
        "kv_invariant_check",
        "disable_overlap_schedule",
        "grammar_backend",
        "grammar_compile_timeout",
        "grammar_max_size",
        "constrained_json_disable_any_whitespace",
        "constrained_json_max_whitespace_cnt",
        "disaggregation_timeout",
        "disaggregation_bootstrap_port",
        "dist_timeout",
        "torch_compile_max_bs",
        "torch_compile_at_start",
        "disable_mtp_round_graph",  # round graphs are never compiled
    }
)

# what this process did with packages: "loaded", "compiled" (and packaged), "stale" (a
# package removed and its shape compiled afresh), "unpackaged" (compiled with torch.compile)
stats: Counter[str] = Counter()


class StalePackage(Exception):
    """A package that does not fit this process (or is not a package at all)."""


@functools.cache
def _source_digest() -> str:
    """A digest of every srt_ascend source file (a code change may change a forward)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def model_identity(server_args, model_path: str) -> dict:
    """What every shape's key shares: the code, torch, the checkpoint's config and the
    server arguments that can change a forward."""
    config = os.path.join(model_path, "config.json")
    with open(config, "rb") as f:
        config_digest = hashlib.sha256(f.read()).hexdigest()
    args = {
        f.name: repr(getattr(server_args, f.name))
        for f in dataclasses.fields(server_args)
        if f.name not in SERVING_ONLY_ARGS
    }
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "source": _source_digest(),
        "config": config_digest,
        "args": args,
    }


def package_key(identity: dict, shape: tuple, kind_repr: str, threads, options: dict) -> str:
    blob = json.dumps(
        [identity, list(shape), kind_repr, threads, sorted(options.items())],
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _children(obj) -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items() if isinstance(k, (str, int))]
    if isinstance(obj, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(obj)]
    if isinstance(obj, nn.Module) or type(obj).__module__.startswith("srt_ascend"):
        return list(getattr(obj, "__dict__", {}).items())
    return []


def _walkable(obj) -> bool:
    return isinstance(obj, (torch.Tensor, nn.Module, dict, list, tuple)) or type(
        obj
    ).__module__.startswith("srt_ascend")


def tensor_names(roots: dict[str, object]) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor reachable from `roots` through attributes, dict entries and list items
    (nn.Modules and srt_ascend objects only), by id: its shortest path (breadth first, in
    attribute order) and the tensor. The same construction gives the same names in every
    process."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    queue = deque((name, obj) for name, obj in roots.items() if obj is not None)
    while queue:
        name, obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = (name, obj)
            continue
        queue.extend((f"{name}.{k}", v) for k, v in _children(obj) if _walkable(v))
    return found


def _layout(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype)]


def _alias_plan(tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """(bases, plan): tensors sharing a storage become one flat base over the whole storage;
    plan[i] = [base index, None] for a tensor passed as is, or [base index, [size, stride,
    offset]] for a view re-made from its base inside the graph."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    bases: list[torch.Tensor] = []
    base_of: dict[int, int] = {}
    for ptr, idxs in groups.items():
        first = tensors[idxs[0]]
        base_of[ptr] = len(bases)
        if len(idxs) == 1:
            bases.append(first)
            continue
        if any(tensors[i].dtype != first.dtype for i in idxs):
            raise StalePackage("inputs of different dtypes share a storage")
        n = first.untyped_storage().nbytes() // first.element_size()
        bases.append(first.as_strided((n,), (1,), 0))
    plan = []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        view = None
        if len(groups[ptr]) > 1:
            view = [list(t.shape), list(t.stride()), t.storage_offset()]
        plan.append([base_of[ptr], view])
    return bases, plan


class _FromBases(nn.Module):
    """The captured graph over de-aliased inputs (`_alias_plan`)."""

    def __init__(self, gm: nn.Module, plan: list) -> None:
        super().__init__()
        self.gm, self.plan = gm, plan

    def forward(self, *bases):
        args = [bases[b] if v is None else bases[b].as_strided(*v) for b, v in self.plan]
        return tuple(self.gm(*args))


_EXTRACT_LOCK = threading.Lock()


def _load_package(path: str):
    """`aoti_load_package`, leaving nothing in the temporary directory. The loader extracts
    the package (its shared library, a few MB) into a directory of $TMPDIR that only the
    loaded model's destructor removes, which a server stopped by a signal never runs: each
    start left one such directory per shape. Here it extracts into a scratch directory that
    is removed once the library is loaded (a mapped library outlives its file)."""
    tempfile.gettempdir()  # Python's own temporary files keep the real $TMPDIR
    with _EXTRACT_LOCK:
        scratch = tempfile.mkdtemp(prefix="srt-aoti-load-")
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch
        try:
            return torch._inductor.aoti_load_package(path)
        finally:
            if old is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = old
            shutil.rmtree(scratch, ignore_errors=True)


class PackagedForward:
    """A loaded package bound to this process's tensors: calling it runs the forward."""

    def __init__(self, path: str, roots: dict[str, object]) -> None:
        try:
            model = _load_package(path)
            meta = json.loads(model.get_metadata()[_META])
        except Exception as e:  # a truncated or foreign file: many exception types
            raise StalePackage(f"cannot load: {e!r}") from e
        if meta.get("format") != FORMAT:
            raise StalePackage("package format differs")
        by_name = {name: t for name, t in tensor_names(roots).values()}
        missing = [n for n in meta["inputs"] if n not in by_name]
        if missing:
            raise StalePackage(f"no tensor named {missing[0]}")
        tensors = [by_name[n] for n in meta["inputs"]]
        for name, t, layout in zip(meta["inputs"], tensors, meta["layouts"]):
            if _layout(t) != layout:
                raise StalePackage(f"{name}: {_layout(t)} != {layout}")
        bases, plan = _alias_plan(tensors)
        if plan != meta["plan"]:
            raise StalePackage("inputs share storages differently")
        self._model, self._bases, self._outputs = model, bases, meta["user_outputs"]

    def __call__(self) -> tuple[torch.Tensor, ...]:
        outs = self._model(*self._bases)
        return tuple(outs[i] for i in self._outputs)


def compile_package(
    body: Callable[[], tuple[torch.Tensor, ...]],
    roots: dict[str, object],
    path: str,
    options: dict,
) -> None:
    """Captures `body` with dynamo, exports it and writes its AOTInductor package to `path`
    (atomically). Raises StalePackage when the forward reads a tensor `roots` do not reach
    (it then cannot be packaged)."""
    captured: dict = {}

    def record(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)

        def run(*args):
            captured["outs"] = outs = gm(*args)
            return outs

        return run

    result = torch.compile(body, backend=record, fullgraph=True, dynamic=False)()
    gm, inputs, outs = captured["gm"], captured["inputs"], list(captured["outs"])
    try:
        user_outputs = [next(i for i, o in enumerate(outs) if o is r) for r in result]
    except StopIteration:
        raise StalePackage("a result is not a graph output") from None
    names = tensor_names(roots)
    unnamed = [tuple(t.shape) for t in inputs if id(t) not in names]
    if unnamed:
        raise StalePackage(f"inputs not reachable from the forward's state: {unnamed}")
    bases, plan = _alias_plan(inputs)
    meta = {
        "format": FORMAT,
        "inputs": [names[id(t)][0] for t in inputs],
        "layouts": [_layout(t) for t in inputs],
        "plan": plan,
        "user_outputs": user_outputs,
    }
    program = torch.export.export(_FromBases(gm, plan), tuple(bases), strict=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-", suffix=".pt2")
    os.close(fd)
    try:
        configs = {**options, "aot_inductor.metadata": {_META: json.dumps(meta)}}
        torch._inductor.aoti_compile_and_package(
            program, package_path=tmp, inductor_configs=configs
        )
        os.chmod(tmp, 0o644)  # mkstemp's 0600: readable by whoever shares the cache
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# a partial package untouched this long was left by a killed compile, not one in progress
ABANDONED_PARTIAL_S = 3600


def remove_abandoned_partials(directory: str, now: float | None = None) -> int:
    """Removes the partial packages (`compile_package`'s temporary files) that a compile killed
    before its rename left in `directory`; a recent one may be another process's compile in
    progress and is kept. Returns how many were removed."""
    now = time.time() if now is None else now
    removed = 0
    for path in glob.glob(os.path.join(directory, ".partial-*.pt2")):
        try:
            if now - os.path.getmtime(path) > ABANDONED_PARTIAL_S:
                os.remove(path)
                removed += 1
        except OSError:  # removed meanwhile by another process
            pass
    return removed


class PackageStore:
    """The packages of one model runner's compiled shapes, under `cache_dir`/aoti/."""

    def __init__(
        self, cache_dir: str, identity: dict, options: dict, roots: dict[str, object]
    ) -> None:
        self.dir = os.path.join(cache_dir, PACKAGE_DIR)
        self.identity, self.options, self.roots = identity, options, roots
        remove_abandoned_partials(self.dir)

    def path(self, shape: tuple, kind_repr: str, threads) -> str:
        key = package_key(self.identity, shape, kind_repr, threads, self.options)
        return os.path.join(self.dir, f"{shape[0]}-b{shape[1]}-w{shape[2]}-{key}.pt2")

    def load(self, path: str, roots: dict[str, object]) -> PackagedForward | None:
        """The package at `path` bound to these tensors, run once (over the zeroed static
        buffers: padding only); None when there is none, or (then removed, with a warning)
        it is stale or corrupt."""
        if not os.path.exists(path):
            return None
        try:
            fwd = PackagedForward(path, {**roots, **self.roots})
            fwd()  # runs once here: a package that loads but cannot run is stale too
        except Exception as e:  # StalePackage, or whatever its code raised
            logger.warning(
                "compile cache: %s is stale or corrupt (%s); compiling it again",
                os.path.basename(path),
                e,
            )
            stats["stale"] += 1
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        stats["loaded"] += 1
        return fwd

    def compile(self, body, path: str, roots: dict[str, object]) -> PackagedForward | None:
        """Compiles `body` into a package at `path` and loads it; None (logged) when the
        forward cannot be packaged."""
        all_roots = {**roots, **self.roots}
        try:
            compile_package(body, all_roots, path, self.options)
            fwd = PackagedForward(path, all_roots)
            fwd()
        except Exception as e:  # export / AOTInductor limits: torch.compile as before
            logger.warning(
                "compile cache: %s cannot be packaged (%r); compiling it with torch.compile",
                os.path.basename(path),
                e,
            )
            stats["unpackaged"] += 1
            if os.path.exists(path):  # written but unusable: no later start should load it
                os.remove(path)
            return None
        stats["compiled"] += 1
        return fwd
