"""ModelRunner: owns the model weights, the KV pools, the attention backend and the graphs.

Which forwards are captured as graphs, and through which attention backend each runs, is
decided by the decoder (`decoding/`), which hands its GraphKinds to `capture_graphs` and names
the kind when it calls `forward` / `forward_mtp`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from srt_ascend.distributed import SINGLE, TPGroup, set_fixed_order_sums
from srt_ascend.layers import linear as layers_linear
from srt_ascend.layers.attention.base import create_attention_backend
from srt_ascend.layers.attention.batch_invariant import batch_invariant_backend
from srt_ascend.layers.attention.device_plan import resolve_attention_plan
from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt_ascend.model_executor.compile_packages import PackageStore, model_identity
from srt_ascend.model_executor.dp_graph import agree_replay, demand, token_counts
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.graph_runner import (
    MIN_KV_WINDOW,
    GraphKind,
    GraphRunner,
    Replayed,
    graph_buckets,
)
from srt_ascend.model_executor.kernel_warmup import warm_up_kernels
from srt_ascend.model_executor.torch_compile import compile_max_bs, set_intra_op_threads
from srt_ascend.models.loader import load_config, load_model, shard_files
from srt_ascend.models.quant_config import refused_with, resolve_quantization
from srt_ascend.models.weight_memory import weight_memory
from srt_ascend.platforms import Platform
from srt_ascend.sampling import static_sampling
from srt_ascend.sampling.sample_step import greedy_tokens
from srt_ascend.server_args import MAX_SPEC_STEPS, ServerArgs
from srt_ascend.utils import to_device

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, config) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if isinstance(ckpt, torch.dtype):
        return ckpt
    return _DTYPES.get(str(ckpt).replace("torch.", ""), torch.bfloat16)


class ModelRunner:
    """`tp`: the tensor-parallel group; this runner holds the rank's shard of the weights and
    a full latent KV pool (MLA's latent is shared by every head, so it cannot be split by
    heads), and every rank must run the same forwards in the same order."""

    def __init__(self, server_args: ServerArgs, platform: Platform, tp: TPGroup = SINGLE) -> None:
        import srt_ascend.layers.attention  # noqa: F401  (registers the portable backends)

        server_args = server_args.for_device(platform.name)  # no-op when already resolved
        self.server_args = server_args
        self.platform = platform
        self.tp = tp
        # intra-op threads eager forwards run with (a compiled forward leaves its own count
        # in force for the eager work after it: torch_compile.CompiledForward)
        self.eager_threads = torch.get_num_threads()
        self.device = platform.device
        self.config = load_config(server_args.model_path)
        self.dtype = resolve_dtype(server_args.dtype, self.config)
        deterministic = server_args.enable_deterministic_inference
        self._set_numerics(deterministic)
        self._load_model()
        self.weight_memory = weight_memory([self.model, self.mtp])  # bytes, as loaded
        self.vocab_size = self.config.vocab_size
        # Speculative verify writes up to K positions past the committed length.
        max_ctx = self.config.max_position_embeddings - (
            MAX_SPEC_STEPS + 1 if server_args.spec_enabled else 0
        )
        self.context_len = server_args.context_length or max_ctx
        if self.context_len > max_ctx:
            raise ValueError(
                f"--context-length {self.context_len} exceeds {max_ctx} (the model's "
                f"max_position_embeddings, less the speculative margin)"
            )
        self.num_layers = self.config.num_hidden_layers + (
            self.mtp.num_layers if self.mtp is not None else 0
        )
        # Which verify path and KV layout this device runs for this shape (one-line error if
        # the flags ask for what it cannot run); the MTP decoder verifies by `plan.verify`.
        self.attention_plan = resolve_attention_plan(
            platform.name,
            self.config.num_attention_heads // server_args.attn_tp_size,
            self.config.kv_lora_rank,
            self.config.qk_rope_head_dim,
            server_args.page_size,
            server_args.speculative_verify if server_args.spec_enabled else None,
        )
        if self.attention_plan.fallback:
            logger.info("%s", self.attention_plan.fallback)
        self._init_pools()
        # --attention-backend, else the platform's default (triton on CUDA): for_device;
        # its batch-invariant variant with --enable-deterministic-inference
        backend = server_args.attention_backend
        self.attn_backend = create_attention_backend(
            batch_invariant_backend(backend, self.device.type) if deterministic else backend
        )
        self.graph_runner: GraphRunner | None = None
        self.sample_block: torch.Tensor | None = None  # decode_sampled graphs' settings

    def _set_numerics(self, deterministic: bool) -> None:
        """The process-wide GEMM and all-reduce modes (--cpu-small-gemm, and batch-invariant
        ones under --enable-deterministic-inference, its CPU kernel built now, at load)."""
        server_args, platform = self.server_args, self.platform
        if deterministic and (why := platform.deterministic_unavailable()):
            raise ValueError(
                f"--enable-deterministic-inference is not available on {platform.name}: {why}"
            )
        layers_linear.configure(
            platform.small_gemm_macs(server_args.cpu_small_gemm),
            layers_linear.DETERMINISTIC_ROW_TILE if deterministic else None,
        )
        set_fixed_order_sums(deterministic)  # all-reduces over > 2 ranks in rank order
        if deterministic and self.device.type == "cpu":
            layers_linear.prepare_fixed_order()  # built at load, never in a step

    def _load_model(self) -> None:
        """This rank's model (and MTP module when speculating), in its checkpoint's
        quantization (a one-line error where the settings cannot serve it), in eval mode."""
        server_args = self.server_args
        self.quantization = resolve_quantization(
            server_args.model_path,
            self.config,
            server_args.quantization,
            shard_files(server_args.model_path),
        )
        if self.quantization is not None and (why := refused_with(self.quantization, server_args)):
            raise ValueError(why)
        self.model, self.mtp = load_model(
            server_args.model_path,
            dtype=self.dtype,
            device=self.device,
            load_mtp=server_args.spec_enabled,
            config=self.config,
            tp=self.tp,
            quantization=self.quantization,
        )
        self.model.eval()
        if self.mtp is not None:
            self.mtp.eval()

    def capture_graphs(
        self, kinds: list[GraphKind], smallest_kv_window: int = MIN_KV_WINDOW
    ) -> None:
        """Captures `kinds` per batch-size bucket (and per KV window from `smallest_kv_window`
        for kinds whose attention gathers the whole window), where graphs are on
        (`--disable-cuda-graph`, `--enable-cpu-graph`, `--enable-torch-compile`, the
        platform's default); otherwise does nothing. Buckets up to --torch-compile-max-bs are
        compiled with --enable-torch-compile: here with --torch-compile-at-start, else one
        per `compile_next_graph` call (those buckets are captured uncompiled until then).

        Under data-parallel attention the graphs hold the MLPs' collectives over all ranks
        (every rank captures the same shapes in the same order) and are never compiled:
        torch.compile over those collectives is untested. Collectives inside CUDA graphs
        need NCCL (HCCL for aclgraphs), which this CPU-tested code has not run.

        First, where kernels compile at their first launch (CUDA, NPU), every kernel variant
        the server can launch is launched once (kernel_warmup), graphs on or off: this is
        the scheduler's one call before the server says ready."""
        args = self.server_args
        if self.platform.compiles_kernels:
            warm_up_kernels(self)
        if not args.graphs_enabled(self.platform) or not kinds:
            return
        compile_on = args.enable_torch_compile
        if compile_on and self.tp.dp_size > 1:
            logger.warning("--enable-torch-compile: data-parallel attention runs graphs uncompiled")
            compile_on = False
        compile_max = compile_max_bs(compile_on, args.torch_compile_max_bs, self.platform)
        buckets = graph_buckets(
            args.cuda_graph_bs, min(args.cuda_graph_max_bs, args.max_running_requests)
        )
        if any(kind.sampled for kind in kinds):  # rows past a replay's batch: greedy padding
            self.sample_block = static_sampling.padding_block(buckets[-1], self.device)
        self.graph_runner = GraphRunner(
            self.platform,
            self._captured_forward,
            self.req_to_token_pool,
            self.kv_pool,
            self.config.hidden_size,
            self.dtype,
            buckets,
            kinds,
            smallest_kv_window,
            compile_max,
            self.tp.dp_size,
            self.eager_threads,
            self._compile_packages() if compile_max else None,
        )
        self.graph_runner.capture(defer_compile=not args.torch_compile_at_start)

    def _compile_packages(self) -> PackageStore | None:
        """Where compiled shapes are kept as AOTInductor packages, so that a later start
        loads them (compile_packages.py): on platforms that package (CPU), one rank only
        (a rank's graph may hold its rank; tensor-parallel runs compile at every start)."""
        options = self.platform.package_options
        if options is None or self.tp.size > 1:
            return None
        args = self.server_args
        try:
            identity = model_identity(args, args.model_path)
        except OSError as e:  # no config.json to key packages by
            logger.info("compile cache: no packages (%s)", e)
            return None
        return PackageStore(
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
            identity,
            options,
            {"model": self.model, "mtp": self.mtp},
        )

    def compile_next_graph(self) -> bool:
        """Compiles one more graph (--enable-torch-compile without --torch-compile-at-start)
        and swaps it in; False when none is left. Run it between steps, in the thread that
        runs the forwards (model_executor/torch_compile.py); a failed compile raises and
        leaves that graph uncompiled."""
        return self.graph_runner is not None and self.graph_runner.compile_next()

    def _kv_bytes_per_token(self) -> int:
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return width * self.num_layers * self.dtype.itemsize

    def _init_pools(self) -> None:
        args = self.server_args
        ps = args.page_size
        if args.max_total_tokens is not None:
            size = args.max_total_tokens
        else:
            budget = int(self.platform.total_memory_bytes() * args.mem_fraction_static)
            size = min(
                budget // self._kv_bytes_per_token(), args.max_running_requests * self.context_len
            )
        size = max(ps, size // ps * ps)
        self.max_total_tokens = size
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, self.context_len + MAX_SPEC_STEPS + 2, self.device
        )
        # Which slots are free is host bookkeeping: allocating never waits for the device.
        self.allocator = TokenToKVPoolAllocator(size, ps, "cpu")
        self.kv_pool = MLATokenToKVPool(
            size,
            ps,
            self.dtype,
            self.config.kv_lora_rank,
            self.config.qk_rope_head_dim,
            self.num_layers,
            self.device,
            layout=self.attention_plan.kv_layout,
        )
        logger.info(
            "KV pool: %d tokens, %.1f MB, %d layers",
            size,
            self.kv_pool.mem_usage_bytes() / 2**20,
            self.num_layers,
        )

    def build_forward_batch(
        self,
        mode,
        input_ids,
        req_pool_indices,
        seq_lens,
        extend_lens,
        loc,
        attn_backend=None,
        seq_bounds=None,
    ) -> ForwardBatch:
        """The batch's attention metadata is built by `forward` when it runs eagerly;
        `seq_bounds`: host upper bounds of `seq_lens` on the device (ForwardBatch.build)."""
        return ForwardBatch.build(
            mode,
            input_ids,
            req_pool_indices,
            seq_lens,
            extend_lens,
            loc,
            self.req_to_token_pool,
            self.kv_pool,
            attn_backend or self.attn_backend,
            self.device,
            init_metadata=False,
            seq_bounds=seq_bounds,
        )

    def _run(
        self,
        fb: ForwardBatch,
        kind: GraphKind | None,
        mtp_step: int | None,
        hidden: torch.Tensor | None,
    ) -> Replayed:
        """A replay of `kind`'s graph when one holds `fb` (its logits too, where the kind has
        them), else eager (no logits). Under data-parallel attention with graphs, the ranks
        first exchange their demands and all replay the agreed kind and bucket, or all run
        eagerly (model_executor/dp_graph.py)."""
        graphs = self.graph_runner
        if graphs is not None and self.tp.dp_size > 1:
            demands = self.tp.dp_exchange(graphs.demand(fb, kind))
            choice = agree_replay(demands)
            if choice is not None:
                agreed = graphs.kind_at(choice[0])
                self._check_same_module(agreed, mtp_step)
                return graphs.run(fb, agreed, hidden, bucket=choice[1])
            fb.dp_token_counts = token_counts(demands)
            set_intra_op_threads(self.eager_threads)
            return Replayed(self._forward(fb, mtp_step, hidden), None)
        if graphs is not None and kind is not None:
            out = graphs.run(fb, kind, hidden)
            if out is not None:
                return out
        return Replayed(self.forward_eager(fb, mtp_step, hidden), None)

    def _with_logits(self, out: Replayed, rows: torch.Tensor | None):
        """(hidden, logits of `rows` of it, or of every row when None): the graph's logits
        where it ran the LM head, else the LM head now over those rows only."""
        hidden, logits = out.hidden, out.logits
        if logits is None:
            return hidden, self.compute_logits(hidden if rows is None else hidden[rows])
        return hidden, logits if rows is None else logits[rows]

    def _check_same_module(self, kind: GraphKind, mtp_step: int | None) -> None:
        """The DP ranks agreed on `kind`; this rank runs the main model (mtp_step None) or
        that MTP step. A mismatch means the ranks' forwards are out of step."""
        layer = None if mtp_step is None else self.mtp.layer_for_step(mtp_step)
        if kind.mtp_layer != layer:
            mine = "the main model" if layer is None else f"MTP layer {layer}"
            raise RuntimeError(f"DP ranks out of step: others replay {kind.name}, this runs {mine}")

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, kind: GraphKind | None = None) -> torch.Tensor:
        """Main model forward: a replay of `kind`'s graph when one holds this batch, else
        eager. Returns final-normed hidden states [T, hidden]."""
        return self._run(forward_batch, kind, None, None).hidden

    @torch.inference_mode()
    def forward_logits(
        self, forward_batch: ForwardBatch, kind: GraphKind | None = None, rows=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` and the logits [len(rows) or T, V] (float32) of `rows` (a device index
        tensor; None: every row) of its hidden states. A replayed graph ran the LM head
        over every row inside it (a compiled graph: compiled with the forward); eager, the
        LM head runs over the rows asked for only."""
        return self._with_logits(self._run(forward_batch, kind, None, None), rows)

    @torch.inference_mode()
    def forward_greedy(
        self, forward_batch: ForwardBatch, kind: GraphKind | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` and each row's greedy token [T] (int64, on the device): the argmax of its
        logits over the vocabulary, the rule `sample_tokens` applies to an all-greedy batch
        without logprobs. A graph of a kind with `argmax_vocab` ran that argmax inside it;
        any other replay or an eager forward takes it from the logits (`forward_logits`)."""
        out = self._run(forward_batch, kind, None, None)
        if out.tokens is not None:
            return out.hidden, out.tokens
        hidden, logits = self._with_logits(out, None)
        return hidden, greedy_tokens(logits, self.vocab_size)

    @torch.inference_mode()
    def forward_sampled(
        self, fb: ForwardBatch, kind: GraphKind, block: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, sampled tokens [T]) of a replay of `kind` (GraphKind.sampled) over `fb`,
        its rows' settings and uniforms `block()` (static_sampling.decode_block, drawn only
        when a graph holds the batch) copied into the static block in one host->device copy;
        None where no graph holds `fb` (or under DP attention, whose ranks agree on the kind
        they replay): the caller samples from the logits."""
        graphs = self.graph_runner
        if graphs is None or self.tp.dp_size > 1 or not graphs.can_run(fb, kind):
            return None
        rows = block()
        self.sample_block[: rows.shape[0]].copy_(to_device(rows, self.device, torch.float32))
        out = self._run(fb, kind, None, None)  # a graph holds it: the tokens come back
        return out.hidden, out.tokens

    @torch.inference_mode()
    def forward_mtp(
        self,
        forward_batch: ForwardBatch,
        hidden: torch.Tensor,
        step: int,
        kind: GraphKind | None = None,
    ) -> torch.Tensor:
        """MTP draft forward for draft step `step` (input ids = token t+1, `hidden` = h_t);
        replayed from `kind`'s graph when one holds it. Returns the normed hidden the LM
        head reads."""
        return self._run(forward_batch, kind, step, hidden).hidden

    @torch.inference_mode()
    def forward_mtp_logits(
        self,
        forward_batch: ForwardBatch,
        hidden: torch.Tensor,
        step: int,
        kind: GraphKind | None = None,
        rows=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_mtp` and the logits of `rows` of its output (as `forward_logits`: the
        MTP module shares the main model's LM head)."""
        return self._with_logits(self._run(forward_batch, kind, step, hidden), rows)

    @torch.inference_mode()
    def write_mtp_kv(self, fb: ForwardBatch, hidden: torch.Tensor, layer: int) -> None:
        """The KV MTP layer `layer` writes at `fb`'s positions (input ids = token t+1,
        `hidden` = h_t), eagerly and without the rest of the layer: the same ops as its
        forward's, so the same bits as an eager MTP pass leaves (a pass without drafting
        reads no output). No collective but the embedding's, which every rank runs alike."""
        set_intra_op_threads(self.eager_threads)
        self.mtp.write_kv(fb.input_ids, hidden, fb.positions, fb, layer)

    @torch.inference_mode()
    def forward_eager(
        self, fb: ForwardBatch, mtp_step: int | None = None, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The main model (mtp_step None) or the MTP module at that draft step, never from a
        graph: what every replay must reproduce. Under data-parallel attention it exchanges
        every DP group's token count for the MLPs' gather, stating that it runs no graph (so
        the other ranks do not either: dp_graph)."""
        if self.tp.dp_size > 1:
            fb.dp_token_counts = token_counts(self.tp.dp_exchange(demand(fb.num_tokens)))
        set_intra_op_threads(self.eager_threads)
        return self._forward(fb, mtp_step, hidden)

    def _forward(self, fb: ForwardBatch, mtp_step: int | None, hidden: torch.Tensor | None):
        """`forward_eager` without its inference mode: what the graph runner captures or
        compiles (a compiled graph must not enter inference mode inside); a captured batch
        carries its fixed DP token counts."""
        if fb.attn_metadata is None and not fb.forward_mode.is_idle():
            fb.attn_backend.init_forward_metadata(fb)
        if mtp_step is None:
            return self.model(fb.input_ids, fb.positions, fb)
        return self.mtp(fb.input_ids, hidden, fb.positions, fb, step=mtp_step)

    def _captured_forward(
        self, fb: ForwardBatch, kind: GraphKind, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """What a graph of `kind` captures: the forward, and where the kind has logits the
        LM head over its every row (so a replayed decode, verify or draft step reads logits
        the graph computed); with `argmax_vocab`, their greedy tokens in place of them."""
        out = self._forward(fb, kind.mtp_layer, hidden)
        if not kind.logits:
            return (out,)
        logits = self.model.compute_logits(out)
        if kind.sampled:  # the settings and uniforms of the replay's rows (`forward_sampled`)
            block = self.sample_block[: out.shape[0]]
            vocab = logits[:, : kind.argmax_vocab]
            tokens = static_sampling.sample_rows(vocab, block, kind.filtered)
            return (out, tokens)
        if kind.argmax_vocab is not None:
            return (out, greedy_tokens(logits, kind.argmax_vocab))
        return (out, logits)

    def forward_static(
        self,
        fb: ForwardBatch,
        kind: GraphKind,
        hidden: torch.Tensor | None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of `kind` inside a captured MTP round (speculative/mtp_round_graph):
        the forward over `fb` (static shapes, built on the device), and where the kind has
        logits those of `rows` (a device index tensor; None: every row), else None."""
        out = self._forward(fb, kind.mtp_layer, hidden)
        if not kind.logits:
            return out, None
        return out, self.model.compute_logits(out if rows is None else out.index_select(0, rows))

    @torch.inference_mode()
    def forward_idle(self, mtp_step: int | None = None) -> None:
        """Under data-parallel attention, a forward over no tokens (ForwardMode.IDLE) of the
        main model (mtp_step None) or the MTP module: what a DP group without requests runs in
        place of each forward the others run, so that the MLPs' collectives over all ranks
        pair up; with graphs, a replay of the graph the others replay, over padding only.
        Does nothing without DP attention (no other group waits)."""
        if self.tp.dp_size == 1:
            return
        none = torch.empty(0, dtype=torch.int64)
        fb = self.build_forward_batch(ForwardMode.IDLE, none, [], [], [], none)
        hidden = None
        if mtp_step is not None:
            hidden = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self._run(fb, None, mtp_step, hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
