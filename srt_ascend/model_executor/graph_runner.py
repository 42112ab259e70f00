"""Graph capture/replay of the decode, target-verify and MTP draft forwards (DESIGN section 8).

Each forward *kind* is captured once per batch-size bucket over static buffers sized for the
largest bucket; buckets are captured largest first and share one memory pool. A replay copies
the batch into the buffers, pads it to the bucket (padding rows: KV length 0, padding slot 0),
replays, and slices the real rows back out. Prefill stays eager. A kind's graph holds the LM
head too (`GraphKind.logits`, all but the KV-only passes of later MTP layers): a replay hands
back the hidden states and their float32 logits, so a decode, verify or draft step runs no
eager matmul after its forward (compiled, the LM head is compiled with the forward). A kind
with `argmax_vocab` goes one op further and ends with the greedy argmax: plain decoding's
all-greedy, no-logprob batches replay forward + sampling as one graph and get tokens back;
with `sampled` it ends with sampling instead (sampled batches without logprobs).

A replayed step costs what its live KV needs (DESIGN section 8). Kinds whose attention backend
gathers the whole static KV window (torch_native) are also captured per KV window: powers of
two from 64 up to half the req_to_token width, then the width itself, and a replay takes the
smallest window that holds the batch's longest row. Backends whose op reads the lengths on the
device (triton) or takes them from the host per replay (FIA) walk only the live KV, so one
graph per batch bucket, over the full width, serves every length.

Kinds (B = requests in the bucket, K = draft tokens per step):
- decode:         main model, B rows of 1 token;
- decode_greedy:  the same, ending with the argmax (tokens, no logits);
- decode_sampled: the same, ending with sampling (temperature, min-p and the uniforms from
                  a static block the host fills: tokens, no logits);
- decode_filtered: the same with the top-k / top-p masks (a sort per row; any batch with
                  top-k, top-p or a greedy row beside sampled ones);
- verify_expand:  main model, B(1+K) single-token rows (batch expansion); a ragged verify's
                  sum(1+k_r) rows replay the smallest bucket whose B(1+K) rows hold them;
- verify_fia:     main model, B + spare rows through the FIA backend, B(1+K) tokens;
- draft_extend:   MTP layer 0 over B rows of 1+K tokens (the pass after verify);
- draft_extend_l{l}: a later MTP layer l of a multi-layer checkpoint, the same pass (its KV);
- draft_step{l}:  MTP layer l over B rows of 1 token (draft steps 2..K);
- draft_chain{j}_l{l}: draft step j+1 starting MTP layer l, B rows of j tokens.
A whole MTP round (those forwards, the acceptance and the next d_1 between them; greedy and
sampled variants) is captured apart, per (K, bucket[, KV window]), in this runner's pool and stream
(speculative/mtp_round_graph.py); its replays are counted here as `mtp_round_k{K}`, the
sampled variant's also as `mtp_round_sampled_k{K}`.

Which kinds exist is the decoders' business: each hands its GraphKinds (with the attention
backend the kind runs through) to `ModelRunner.capture_graphs`, and names the kind when it
runs a forward, so nothing here guesses a kind from a batch. The graph class comes from the
platform: CUDA graphs, aclgraphs, or on CPU an eager replay over the same buffers, so the
capture/pad/replay logic runs in every test. Buckets up to `compile_max_bs`
(--enable-torch-compile) capture the forward compiled (model_executor/torch_compile.py): at
capture, or (`capture(defer_compile=True)`) captured uncompiled first and compiled one shape
per `compile_next` call, which swaps the compiled graph in; the caller runs it between steps,
in the thread that replays (the rule is in torch_compile.py's docstring). A shape whose
package is in the compile cache (compile_packages.py) is loaded compiled at capture either way.

Under data-parallel attention (`dp_size` > 1) a captured forward gathers its padded rows from
every DP group before each MLP, and all ranks replay the same kind and bucket, or none does:
model_executor/dp_graph.py states the rule, `demand` and `kind_at` serve it, and
`try_replay(..., bucket=)` replays the agreed bucket (over padding only for an idle group).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from srt_ascend.layers.attention.base import AttentionBackend
from srt_ascend.layers.attention.fia_reference import MAX_QUERY_TOKENS_PER_REQ, to_cumulative
from srt_ascend.model_executor import dp_graph
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.torch_compile import (
    CompiledForward,
    CompileQueue,
    Shape,
    allow_compiled_shapes,
    set_intra_op_threads,
)
from srt_ascend.utils import to_device

if TYPE_CHECKING:
    from srt_ascend.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from srt_ascend.model_executor.compile_packages import PackageStore
    from srt_ascend.platforms import DeviceGraph, Platform

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
MIN_KV_WINDOW = 64


def graph_buckets(requested: Sequence[int] | None, max_bs: int) -> list[int]:
    """Sorted bucket sizes: the requested ones up to `max_bs`, or by default 1, 2, 4, 8, 12,
    16, 24, 32, then every multiple of 16, up to and including `max_bs`."""
    if requested:
        return sorted({b for b in requested if b <= max_bs} or {max_bs})
    sizes = {b for b in DEFAULT_BUCKETS if b <= max_bs} | set(range(48, max_bs + 1, 16))
    return sorted(sizes | {max_bs})


def kv_windows(width: int, smallest: int = MIN_KV_WINDOW) -> list[int]:
    """KV windows a kind that gathers its whole window is captured for: the powers of two from
    `smallest` up to half of `width` (the req_to_token row), then `width`, so each window at
    most doubles the one before it and none nearly repeats the full width; just [width] when
    `width` < 2 * `smallest` (one window: the cost of the full context at every length)."""
    windows = []
    w = smallest
    while 2 * w <= width:
        windows.append(w)
        w *= 2
    return [*windows, width]


def fia_spare_slots(bucket: int, k: int) -> int:
    """Extra request slots a verify graph keeps so that a bucket full of 1-token requests (just
    arrived from a prefill node, no draft yet) can still hand its unused tokens to padding
    requests of at most 16 tokens each."""
    return -(-bucket * k // MAX_QUERY_TOKENS_PER_REQ)


def fia_padded_query_lens(q_lens: Sequence[int], num_slots: int, total_tokens: int, per_req: int):
    """Per-slot query lengths of a captured FIA verify batch (DESIGN section 8).

    Real requests keep their lengths (1 or 1+K); each padding slot up to the bucket takes
    `per_req` = 1+K tokens, so a full-length batch pads as [1+K, 2(1+K), ..., bucket(1+K)];
    tokens real 1-token requests left unused go to the spare slots, at most 16 each, and the
    remaining slots get 0. The cumulative lengths then end exactly at `total_tokens`."""
    if any(not 1 <= q <= MAX_QUERY_TOKENS_PER_REQ for q in q_lens):
        raise ValueError(f"query lengths must be in [1, {MAX_QUERY_TOKENS_PER_REQ}]: {q_lens}")
    lens = list(q_lens)
    left = total_tokens - sum(lens)
    if left < 0 or len(lens) > num_slots:
        raise ValueError(f"{len(lens)} requests / {sum(lens)} tokens exceed the graph's size")
    bucket_slots = total_tokens // per_req
    for _ in range(len(lens), num_slots):
        cap = per_req if len(lens) < bucket_slots else MAX_QUERY_TOKENS_PER_REQ
        take = min(cap, left)
        lens.append(take)
        left -= take
    if left:
        raise ValueError(f"{left} tokens do not fit the graph's {num_slots} slots")
    return lens


@dataclass(frozen=True, eq=False)
class GraphKind:
    """One kind of captured forward, defined by the decoder that runs it."""

    name: str
    mode: ForwardMode
    tokens_per_req: int  # query tokens each request contributes
    rows_per_req: int  # ForwardBatch rows per request
    backend: AttentionBackend  # the attention backend its batches run through
    mtp_layer: int | None = None  # None: the main model; else this MTP layer
    logits: bool = True  # the LM head runs inside the graph (False: its output is KV only)
    # the graph ends with the argmax of its logits over the first `argmax_vocab` columns (the
    # tokenizer's vocabulary) and hands back those tokens instead of the logits: plain
    # decoding's all-greedy, no-logprob batches (their sampling is that argmax)
    argmax_vocab: int | None = None
    # with `argmax_vocab`: the graph ends with sampling over those columns instead, from the
    # settings and uniforms in the runner's static block (sampling/static_sampling): plain
    # decoding's batches `plain_sampling` accepts with some sampled row
    sampled: bool = False
    filtered: bool = False  # with `sampled`: the top-k / top-p masks (a sort per row) too

    @property
    def q_per_row(self) -> int:
        return self.tokens_per_req // self.rows_per_req

    @property
    def host_lengths(self) -> bool:
        """Rows through a backend whose op takes host-side lengths (FIA): those are refreshed
        per replay, and the batch keeps spare request slots (DESIGN section 8)."""
        return self.backend.uses_host_lengths

    @property
    def holds_ragged(self) -> bool:
        """Whether its graphs replay batches whose requests bring fewer query tokens than
        `tokens_per_req` (a ragged verify's, `_bucket`): a backend taking host lengths pads
        them per replay, and single-token rows fill whole requests' rows. Otherwise (one
        multi-token row per request on a device-length backend: the Triton multi-query
        verify) such a batch runs eagerly."""
        return self.host_lengths or self.q_per_row == 1


class _Buffers:
    """Static inputs shared by every graph (sized for the largest bucket of any kind)."""

    def __init__(self, max_tokens: int, max_rows: int, hidden: int, dtype, device) -> None:
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc = (
            z(max_tokens),
            z(max_tokens),
            z(max_tokens),
        )
        self.req_pool_indices, self.seq_lens = z(max_rows), z(max_rows)
        self.hidden = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)

    def zero_(self) -> None:
        """Back to what capture saw: every row padding (KV length 0, KV slot 0)."""
        for t in vars(self).values():  # every field is a static buffer
            t.zero_()


@dataclass
class _Captured:
    graph: DeviceGraph
    fb: ForwardBatch  # over the static buffers; its host lists are refreshed at each replay
    num_tokens: int
    num_rows: int
    compiled: bool  # a torch.compile'd forward (--enable-torch-compile)


class Replayed(NamedTuple):
    """A replay's results for the batch's real tokens (owned by the caller)."""

    hidden: torch.Tensor  # [tokens, D] output hidden states (final-normed)
    logits: torch.Tensor | None  # [tokens, V] float32 from the LM head in the graph, or None
    tokens: torch.Tensor | None = None  # [tokens] int64 argmax, a kind with `argmax_vocab`


# (fb, kind, MTP input hidden or None) -> (output hidden,) or, for a kind with logits,
# (output hidden, its logits): the eager forward a graph captures
EagerForward = Callable[[ForwardBatch, GraphKind, "torch.Tensor | None"], tuple[torch.Tensor, ...]]


class GraphRunner:
    """Narrow handles: the eager forward to capture, the pools the static batches index, and
    the platform's graph class; it never sees the model runner."""

    def __init__(
        self,
        platform: Platform,
        eager_forward: EagerForward,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MLATokenToKVPool,
        hidden_size: int,
        dtype: torch.dtype,
        buckets: Sequence[int],
        kinds: Sequence[GraphKind],
        smallest_kv_window: int = MIN_KV_WINDOW,
        compile_max_bs: int = 0,
        dp_size: int = 1,
        eager_threads: int | None = None,
        packages: PackageStore | None = None,
    ) -> None:
        self.platform = platform
        # compiled shapes as AOTInductor packages in the compile cache (compile_packages.py)
        self.packages = packages
        # intra-op threads of uncompiled replays (compiled ones: CompiledForward's own count)
        self.eager_threads = eager_threads or torch.get_num_threads()
        self.dp_size = dp_size  # DP attention groups whose tokens each MLP gathers
        self.compile_max_bs = compile_max_bs  # buckets up to this are compiled (0: none)
        self.eager_forward = eager_forward
        self.req_to_token_pool, self.kv_pool = req_to_token_pool, kv_pool
        self.buckets = sorted(buckets)
        self.kinds = self._capturable({k.name: k for k in kinds})
        self.static_kv_len = req_to_token_pool.req_to_token.shape[1]
        self.windows = kv_windows(self.static_kv_len, smallest_kv_window)
        max_bs = self.buckets[-1]
        max_tokens = max(k.tokens_per_req for k in self.kinds.values()) * max_bs
        max_rows = max(self._num_rows(k, max_bs) for k in self.kinds.values())
        self.buf = _Buffers(max_tokens, max_rows, hidden_size, dtype, platform.device)
        self.graphs: dict[Shape, _Captured] = {}  # (kind, bucket, KV window)
        self.compile_queue = CompileQueue([], [])  # compiled shapes not compiled yet
        self.replays: Counter[str] = Counter()  # per kind, reported in the internal state
        self.window_replays: Counter[int] = Counter()  # per KV window, likewise
        self.compiled_replays: Counter[str] = Counter()  # per kind, of compiled graphs
        self.pool = self.platform.graph_pool_handle()
        self.stream = self.platform.new_stream()

    def _capturable(self, kinds: dict[str, GraphKind]) -> dict[str, GraphKind]:
        for kind in kinds.values():
            if not kind.backend.supports_static_shapes:
                raise ValueError(
                    f"graphs need attention backends that support static shapes; "
                    f"{type(kind.backend).__name__} does not: pass --disable-cuda-graph"
                )
        if self.platform.new_graph().supports_host_params:
            return kinds
        eager = [name for name, kind in kinds.items() if kind.host_lengths]
        if eager:
            logger.info(
                "%s runs eagerly: this device's graphs cannot refresh host-side lengths",
                ", ".join(eager),
            )
        return {name: kind for name, kind in kinds.items() if name not in eager}

    @staticmethod
    def _num_rows(kind: GraphKind, bs: int) -> int:
        """ForwardBatch rows of a captured batch: the requests' rows, plus FIA's spare slots."""
        spare = fia_spare_slots(bs, kind.tokens_per_req - 1) if kind.host_lengths else 0
        return bs * kind.rows_per_req + spare

    def kind_windows(self, kind: GraphKind) -> list[int]:
        """The KV windows `kind` is captured for: one (the full width) unless its backend's
        cost grows with the window."""
        return self.windows if kind.backend.reads_whole_kv_window else [self.static_kv_len]

    def graphs_per_kind(self) -> dict[str, int]:
        return dict(Counter(name for name, _, _ in self.graphs))

    # capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, defer_compile: bool = False) -> None:
        """Captures every shape: those of buckets up to `compile_max_bs` compiled, or with
        `defer_compile` uncompiled for now and queued for `compile_next`."""
        self.platform.synchronize()  # static buffers were zeroed on the default stream
        shapes = [
            (kind.name, bs, window)
            for bs in reversed(self.buckets)  # largest first: later graphs fit in its pool
            for kind in self.kinds.values()
            for window in reversed(self.kind_windows(kind))
        ]
        to_compile = [s for s in shapes if s[1] <= self.compile_max_bs]
        self.compile_queue = CompileQueue(to_compile, list(self.kinds))
        for shape in shapes:
            if shape in to_compile and (loaded := self._load_compiled(shape)) is not None:
                self.graphs[shape] = loaded  # from the compile cache: nothing to compile
                self.compile_queue.loaded_from_cache(shape)
            elif defer_compile or shape[1] > self.compile_max_bs:
                self.graphs[shape] = self._capture_one(self.kinds[shape[0]], *shape[1:], False)
        self.platform.synchronize()
        if not defer_compile:
            while self.compile_next():
                pass
        logger.info(
            "captured %d graphs (%s; %d compiled, %d of them loaded from the compile cache, "
            "%d to compile while idle) for batch sizes %s, KV windows %s",
            len(self.graphs),
            ", ".join(f"{name}: {n}" for name, n in self.graphs_per_kind().items()),
            self.compile_queue.compiled,
            self.compile_queue.loaded,
            len(self.compile_queue),
            self.buckets,
            self.windows,
        )

    @torch.inference_mode()
    def compile_next(self) -> bool:
        """Compiles the queued shape `CompileQueue` puts first and swaps its compiled graph
        in for the uncompiled one; False when none is left. Its forwards run over the
        zeroed static buffers (padding: KV slot 0 only). A failed compile raises, and the
        shape keeps its uncompiled graph."""
        if not self.compile_queue:
            return False
        name, bs, window = shape = self.compile_queue.pop()
        compiled = False
        try:
            self.buf.zero_()
            self.platform.synchronize()
            captured = self._capture_one(self.kinds[name], bs, window, True)
            self.platform.synchronize()
            compiled = True
        finally:
            self.compile_queue.done(compiled)
        self.graphs[shape] = captured
        return True

    def _static_batch(self, kind: GraphKind, bs: int, window: int) -> ForwardBatch:
        b = self.buf
        n_tok = bs * kind.tokens_per_req
        n_rows = self._num_rows(kind, bs)
        q_lens = (
            fia_padded_query_lens([], n_rows, n_tok, kind.tokens_per_req)
            if kind.host_lengths
            else [kind.q_per_row] * n_rows
        )
        return ForwardBatch(
            forward_mode=kind.mode,
            input_ids=b.input_ids[:n_tok],
            positions=b.positions[:n_tok],
            req_pool_indices=b.req_pool_indices[:n_rows],
            seq_lens=b.seq_lens[:n_rows],
            extend_seq_lens=torch.tensor(q_lens, dtype=torch.int64, device=self.platform.device),
            out_cache_loc=b.out_cache_loc[:n_tok],
            seq_lens_cpu=[0] * n_rows,
            extend_seq_lens_cpu=q_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=kind.backend,
            static_kv_len=window,
            static_max_q=kind.tokens_per_req if kind.host_lengths else None,
            # every DP group's rows, padding included: fixed collective shapes (dp_graph)
            dp_token_counts=[n_tok] * self.dp_size if self.dp_size > 1 else None,
        )

    @torch.inference_mode()
    def _load_compiled(self, shape: Shape) -> _Captured | None:
        """`shape` captured compiled from its package in the compile cache, or None (no
        packages here, none for this shape, or a stale one, then removed)."""
        if self.packages is None:
            return None
        self.buf.zero_()
        self.platform.synchronize()
        captured = self._capture_one(self.kinds[shape[0]], *shape[1:], True, load_only=True)
        self.platform.synchronize()
        return captured

    def _packaged(self, kind: GraphKind, bs: int, window: int, fb, hidden, body, load_only):
        """`body` compiled through the compile cache's packages: loaded, or (unless
        `load_only`) compiled and packaged; None when there is none to load / it cannot be
        packaged (compile_packages.py)."""
        threads = self.platform.compiled_forward_threads(self.eager_threads)
        shape = (kind.name, bs, window)
        described = (
            f"{kind.mode}|{kind.tokens_per_req}|{kind.rows_per_req}|"
            f"{type(kind.backend).__name__}|{kind.mtp_layer}|{kind.logits}"
        )
        if kind.argmax_vocab is not None:  # kinds without it keep their packages' keys
            way = ("filtered" if kind.filtered else "sampled") if kind.sampled else "argmax"
            described += f"|{way}{kind.argmax_vocab}"
        path = self.packages.path(shape, described, threads)
        roots = {"fb": fb, "hidden": hidden}
        set_intra_op_threads(threads)  # kernels are generated for the threads they run on
        with torch.inference_mode(False), torch.no_grad():
            packaged = self.packages.load(path, roots)
            if packaged is None and not load_only:
                allow_compiled_shapes(1)  # the package's recording backend traces `body`
                packaged = self.packages.compile(body, path, roots)
        if packaged is None:
            return None
        return CompiledForward(self.platform, body, self.eager_threads, compiled=packaged)

    def _capture_one(
        self, kind: GraphKind, bs: int, window: int, compiled: bool, load_only: bool = False
    ) -> _Captured | None:
        """`kind` at (`bs`, `window`) captured, `compiled` or not; with `load_only`, compiled
        from its package only, else None."""
        fb = self._static_batch(kind, bs, window)
        hidden = self.buf.hidden[: fb.num_tokens] if kind.mtp_layer is not None else None

        def body() -> torch.Tensor:
            fb.attn_backend.init_forward_metadata(fb)
            return self.eager_forward(fb, kind, hidden)

        graph = self.platform.new_graph(compiled)
        fn = body
        if compiled:
            body()  # eagerly first: what the compiled graph only reads is built (caches)
            fn = None
            if self.packages is not None:
                fn = self._packaged(kind, bs, window, fb, hidden, body, load_only)
            if fn is None and load_only:
                return None
            if fn is None:  # no packages here, or this shape cannot be packaged
                allow_compiled_shapes(1)  # dynamo traces `body` at the first call below
                fn = CompiledForward(self.platform, body, self.eager_threads)
        with self.platform.stream(self.stream):
            # a compiled forward runs at least once here: it compiles (or its package runs)
            # at capture, not at the first served replay (EagerReplayGraph runs nothing)
            for _ in range(max(graph.warmup_runs, int(compiled))):
                fn()
        graph.capture(fn, self.pool, self.stream)
        return _Captured(graph, fb, fb.num_tokens, fb.batch_size, compiled)

    # replay ----------------------------------------------------------------------------
    def _bucket(self, kind: GraphKind, fb: ForwardBatch) -> int | None:
        if fb.forward_mode != kind.mode:
            return None
        if kind.host_lengths:
            reqs = fb.batch_size
            ok = all(1 <= q <= kind.tokens_per_req for q in fb.extend_seq_lens_cpu)
        else:  # single-token rows (a ragged verify_expand) fill whole requests' rows
            reqs, rem = divmod(fb.batch_size, kind.rows_per_req)
            reqs += bool(rem) and kind.q_per_row == 1
            ok = (rem == 0 or kind.q_per_row == 1) and all(
                q == kind.q_per_row for q in fb.extend_seq_lens_cpu
            )
        if not ok or reqs == 0 or reqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= reqs)

    def _window(self, kind: GraphKind, fb: ForwardBatch) -> int:
        """The smallest captured KV window of `kind` that holds the batch's longest row."""
        longest = max(fb.seq_lens_cpu, default=0)
        return next(w for w in self.kind_windows(kind) if w >= longest)

    def bucket_for(self, fb: ForwardBatch, kind: GraphKind) -> int | None:
        """The smallest captured bucket of `kind` that holds `fb`, or None."""
        return self._bucket(kind, fb) if kind.name in self.kinds else None

    def can_run(self, fb: ForwardBatch, kind: GraphKind) -> bool:
        return self.bucket_for(fb, kind) is not None

    def demand(self, fb: ForwardBatch, kind: GraphKind | None) -> list[int]:
        """This rank's demand for the forward of `fb` under data-parallel attention
        (dp_graph.demand): its tokens, and `kind` with its bucket where one holds `fb`."""
        bucket = None if kind is None or fb.num_tokens == 0 else self.bucket_for(fb, kind)
        index = None if bucket is None else list(self.kinds).index(kind.name)
        return dp_graph.demand(fb.num_tokens, index, bucket)

    def kind_at(self, index: int) -> GraphKind:
        """The captured kind a demand names by `index`."""
        return list(self.kinds.values())[index]

    def replay(
        self, fb: ForwardBatch, kind: GraphKind, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`run`'s hidden states; raises when no graph holds the batch."""
        out = self.run(fb, kind, hidden)
        if out is None:
            raise ValueError(f"no captured {kind.name} graph holds this batch")
        return out.hidden

    def try_replay(
        self,
        fb: ForwardBatch,
        kind: GraphKind,
        hidden: torch.Tensor | None = None,
        bucket: int | None = None,
    ) -> torch.Tensor | None:
        """`run`'s hidden states, or None."""
        out = self.run(fb, kind, hidden, bucket)
        return None if out is None else out.hidden

    @torch.inference_mode()
    def run(
        self,
        fb: ForwardBatch,
        kind: GraphKind,
        hidden: torch.Tensor | None = None,
        bucket: int | None = None,
    ) -> Replayed | None:
        """Runs `fb` (eager-built, real rows only) through the captured graph of `kind`;
        returns the real tokens' hidden states [fb.num_tokens, D] and, for a kind with
        logits, their logits [fb.num_tokens, V] (copies where the graph reuses its outputs),
        or None when no graph of that kind holds the batch. `bucket`: the one the DP ranks
        agreed on (dp_graph), at least `fb`'s own; `fb` may then have no rows at all (an idle
        DP group), and the graph runs over padding only."""
        if bucket is None:
            bucket = self.bucket_for(fb, kind)
            if bucket is None:
                return None
        window = self._window(kind, fb)
        g = self.graphs[kind.name, bucket, window]
        if not g.compiled:
            self.compile_queue.hit((kind.name, bucket, window))
            set_intra_op_threads(self.eager_threads)
        n_tok, n_rows, b = fb.num_tokens, fb.batch_size, self.buf
        for dst, src, n, total in (
            (b.input_ids, fb.input_ids, n_tok, g.num_tokens),
            (b.positions, fb.positions, n_tok, g.num_tokens),
            (b.out_cache_loc, fb.out_cache_loc, n_tok, g.num_tokens),  # padding: slot 0
            (b.req_pool_indices, fb.req_pool_indices, n_rows, g.num_rows),
            (b.seq_lens, fb.seq_lens, n_rows, g.num_rows),  # padding rows: KV length 0
        ):
            dst[:n].copy_(src)
            dst[n:total].zero_()
        if hidden is not None:
            b.hidden[:n_tok].copy_(hidden)
            b.hidden[n_tok : g.num_tokens].zero_()
        host = None
        g.fb.seq_lens_cpu[:] = list(fb.seq_lens_cpu) + [0] * (g.num_rows - n_rows)
        g.fb.host_lengths_exact = fb.host_lengths_exact
        if kind.host_lengths:
            g.fb.extend_seq_lens_cpu[:] = fia_padded_query_lens(
                fb.extend_seq_lens_cpu, g.num_rows, g.num_tokens, kind.tokens_per_req
            )
            g.fb.extend_seq_lens.copy_(
                to_device(g.fb.extend_seq_lens_cpu, g.fb.extend_seq_lens.device)
            )
            host = {
                "actual_seq_lengths": to_cumulative(g.fb.extend_seq_lens_cpu),
                "actual_seq_lengths_kv": list(g.fb.seq_lens_cpu),
            }
        outs = g.graph.replay(host)
        self.replays[kind.name] += 1
        self.window_replays[window] += 1
        self.compiled_replays[kind.name] += g.compiled
        real = [o[:n_tok].clone() if g.graph.outputs_reused else o[:n_tok] for o in outs]
        if kind.argmax_vocab is not None:
            return Replayed(real[0], None, real[1])
        return Replayed(real[0], real[1] if kind.logits else None)
