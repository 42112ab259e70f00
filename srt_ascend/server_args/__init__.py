"""ServerArgs: one frozen config, parsed from SGLang's flag names.

One flat frozen dataclass (its fields below, in the order of its constructor); each flag
group's allowed values, derived properties, checks and CLI flags live in a module of this
package: api, scheduling, parallel, disaggregation, constrained, speculative, graphs. Each
contributes a mixin of properties and `_check_*` methods (no fields) and an
`add_*_flags(parser, fields)` that `ServerArgs.add_cli_args` calls in --help's order.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass

from srt_ascend.server_args.api import REDACTED, SECRET_FIELDS, ApiArgsMixin, add_api_flags
from srt_ascend.server_args.constrained import GRAMMAR_BACKENDS, add_constrained_flags
from srt_ascend.server_args.disaggregation import (
    DISAGGREGATION_MODES,
    DisaggregationArgsMixin,
    add_disaggregation_flags,
)
from srt_ascend.server_args.graphs import GraphArgsMixin, add_graph_flags
from srt_ascend.server_args.parallel import (
    LOAD_BALANCE_METHODS,
    MOE_A2A_BACKENDS,
    ParallelArgsMixin,
    add_parallel_flags,
)
from srt_ascend.server_args.quantization import (
    QUANTIZATION_FORMATS,
    QuantizationArgsMixin,
    add_quantization_flags,
)
from srt_ascend.server_args.scheduling import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    SchedulingArgsMixin,
    add_overlap_flags,
    add_scheduling_flags,
)
from srt_ascend.server_args.speculative import (
    MAX_SPEC_STEPS,
    SpeculativeArgsMixin,
    add_speculative_flags,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_ATTENTION_BACKEND",
    "DISAGGREGATION_MODES",
    "GRAMMAR_BACKENDS",
    "LOAD_BALANCE_METHODS",
    "MAX_SPEC_STEPS",
    "MOE_A2A_BACKENDS",
    "QUANTIZATION_FORMATS",
    "REDACTED",
    "SECRET_FIELDS",
    "SHIPPED_MODEL",
    "ServerArgs",
    "prepare_server_args",
]

SHIPPED_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "checkpoints", "deepseek-v3-tiny-mtp"
)


@dataclass(frozen=True)
class ServerArgs(
    ApiArgsMixin,
    SchedulingArgsMixin,
    ParallelArgsMixin,
    DisaggregationArgsMixin,
    SpeculativeArgsMixin,
    GraphArgsMixin,
    QuantizationArgsMixin,
):
    model_path: str = SHIPPED_MODEL
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # None: detected from the checkpoint (QUANTIZATION_FORMATS)
    context_length: int | None = None
    random_seed: int = 0
    log_level: str = "info"
    # API and admission
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_body_mb: float = 32.0
    request_read_timeout: float = 30.0  # seconds to receive a whole request (headers + body)
    max_queued_requests: int | None = None
    max_prompts_per_request: int = 4096  # generations one HTTP request may ask (prompts x n)
    shutdown_timeout: float = 20.0
    # request bounds (issue 46): SGLang's body bound in bytes, one bound with
    # --max-request-body-mb (None: that flag's); the most tokens a text any route tokenizes
    # may have (None: the context length)
    max_payload_size: int | None = None
    max_tokenize_tokens: int | None = None
    # memory and scheduling
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.1
    chunked_prefill_size: int = 1024
    page_size: int | None = None  # None: per device (for_device)
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    attention_backend: str | None = None  # None: the platform's default (attention_backend_on)
    num_threads: int | None = None
    cpu_small_gemm: str = "auto"
    # every position's result a function of its token prefix alone (batch-invariant kernels)
    enable_deterministic_inference: bool = False
    stream_interval: int = 1
    decode_log_interval: int = 40  # decode steps between two "Decode batch." log lines
    enable_metrics: bool = False  # accepted for SGLang: /metrics is always on here
    enable_cache_report: bool = False  # accepted for SGLang: usage always has cached_tokens
    kv_invariant_check: str = "log"  # when idle: "log" a broken KV invariant, or "fatal"
    disable_overlap_schedule: bool = False  # SGLang's flag: the serial step loop
    # overlap where the platform would run serially (eager forwards on CPU)
    enable_overlap_schedule: bool = False
    # parallelism
    tp_size: int = 1
    ep_size: int = 1  # 1, or --tp-size: routed experts partitioned over the TP ranks
    dist_init_addr: str | None = None  # host:port; None: a free port on 127.0.0.1 (one node)
    nnodes: int = 1
    node_rank: int = 0
    dist_timeout: int | None = 600  # seconds a collective waits for a peer; None: torch's
    # data-parallel attention: --dp-size groups of tp/dp ranks, each with its own requests
    enable_dp_attention: bool = False
    dp_size: int = 1
    load_balance_method: str = "round_robin"  # which DP group a new request goes to
    moe_a2a_backend: str = "none"  # expert-parallel dispatch/combine (MOE_A2A_BACKENDS)
    # constrained generation
    constrained_json_disable_any_whitespace: bool = False
    grammar_backend: str = "xgrammar"  # GRAMMAR_BACKENDS
    # SGLang's opt-in for user-supplied logit processors: refused (check), not implemented here
    enable_custom_logit_processor: bool = False
    constrained_json_max_whitespace_cnt: int = 16  # 0: unbounded (SGLang's default)
    grammar_compile_timeout: float = 30.0  # seconds one grammar may compile
    grammar_max_size: int = 131072  # characters of a grammar's source
    # prefill-decode disaggregation (docs/disaggregation.md)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998  # the prefill server's bootstrap endpoint
    disaggregation_ib_device: str | None = None  # RDMA device(s); None: TCP
    disaggregation_timeout: float = 60.0  # seconds a request waits for its peer / its KV
    # speculative decoding
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 1
    speculative_num_draft_tokens: int | None = None
    speculative_eagle_topk: int = 1
    speculative_verify: str | None = None  # None: per device and model shape
    speculative_accept_method: str = "token"  # token | block (Sun et al. block verification)
    speculative_adaptive: bool = False  # choose K in 0..num_steps per step (draft_length)
    # graphs
    disable_cuda_graph: bool = False
    enable_cpu_graph: bool = False
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs: int = 32
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    torch_compile_at_start: bool = False  # else serve at once, compile while idle
    disable_mtp_round_graph: bool = False  # MTP: per-forward graphs only, no whole-round graph

    def __post_init__(self) -> None:
        self.check()

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def for_device(self, device_type: str) -> ServerArgs:
        """These settings with the per-device defaults filled in for what was not given:
        --page-size (128 on NPU, FIA's block size; 1 elsewhere) and, where the device alone
        decides it, --speculative-verify (fia off NPU; on NPU the model's shape decides, see
        `layers.attention.device_plan.resolve_attention_plan`). Called once the device is
        known, before anything reads these fields; --attention-backend too
        (`attention_backend_on`)."""
        from srt_ascend.layers.attention.device_plan import default_page_size, default_verify

        page_size = self.page_size or default_page_size(device_type)
        verify = self.speculative_verify or default_verify(device_type)
        return dataclasses.replace(
            self,
            page_size=page_size,
            speculative_verify=verify,
            attention_backend=self.attention_backend_on(device_type),
        )

    def check(self) -> None:
        """Raises ValueError with a one-line message for a setting that makes no sense."""
        if not os.path.isdir(self.model_path):
            raise ValueError(f"--model-path {self.model_path!r} is not a directory")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("--num-threads must be >= 1")
        if self.kv_invariant_check not in ("log", "fatal"):
            raise ValueError("--kv-invariant-check must be log or fatal")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.decode_log_interval < 1:
            raise ValueError("--decode-log-interval must be >= 1")
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError(
                "--enable-overlap-schedule and --disable-overlap-schedule are exclusive"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < (self.page_size or 1):
            raise ValueError("--chunked-prefill-size must be -1 (off) or >= --page-size")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.max_prompts_per_request < 1:
            raise ValueError("--max-prompts-per-request must be >= 1")
        if not self.max_request_body_mb > 0:
            raise ValueError("--max-request-body-mb must be > 0")
        self._check_request_bounds()
        if not self.shutdown_timeout >= 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if not self.request_read_timeout > 0:
            raise ValueError("--request-read-timeout must be > 0")
        if self.api_key == "" or self.admin_api_key == "":
            raise ValueError("--api-key and --admin-api-key must not be empty")
        self._check_limits_and_kernels()
        self._check_sglang_features()
        self._check_quantization()
        self._check_parallel()
        self._check_disaggregation()
        if self.spec_enabled:
            self._check_speculative()

    def _check_limits_and_kernels(self) -> None:
        """`check`'s second half (grammar bounds, memory, kernels, graphs), in its order."""
        if self.constrained_json_max_whitespace_cnt < 0:
            raise ValueError("--constrained-json-max-whitespace-cnt must be >= 0 (0: unbounded)")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        if self.grammar_max_size < 1:
            raise ValueError("--grammar-max-size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be >= 16")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.cpu_small_gemm not in ("auto", "on", "off"):
            raise ValueError(
                f"--cpu-small-gemm must be auto, on or off, got {self.cpu_small_gemm!r}"
            )
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"unknown --attention-backend {self.attention_backend!r} "
                f"({', '.join(ATTENTION_BACKENDS)})"
            )
        if (
            self.attention_backend == "triton"
            and self.device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError("--attention-backend triton needs --device cuda; use torch_native")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"unknown --schedule-policy {self.schedule_policy!r} (fcfs, lpm)")
        if self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if self.torch_compile_max_bs < 1:
            raise ValueError("--torch-compile-max-bs must be >= 1")
        if self.cuda_graph_bs is not None and (
            not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1
        ):
            raise ValueError("--cuda-graph-bs sizes must be >= 1")
        if self.enable_deterministic_inference and self.enable_torch_compile:
            raise ValueError(
                "--enable-deterministic-inference cannot be combined with --enable-torch-compile: "
                "inductor's generated GEMMs and reductions are not batch-invariant"
            )

    def _check_sglang_features(self) -> None:
        """SGLang flags whose other values or features this server lacks: one line naming
        the flag."""
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"--grammar-backend {self.grammar_backend!r} is not available here "
                f"(accepted: {', '.join(GRAMMAR_BACKENDS)})"
            )
        if self.grammar_backend == "llguidance" and importlib.util.find_spec("llguidance") is None:
            raise ValueError(
                "--grammar-backend llguidance needs the llguidance package (pip install llguidance)"
            )
        if self.enable_custom_logit_processor:
            raise ValueError(
                "--enable-custom-logit-processor is not supported: this server does not run "
                "user-supplied logit processors (SGLang's custom_logit_processor and "
                "custom_params request fields are refused with HTTP 400)"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs.__dataclass_fields__
        a = parser.add_argument
        a(
            "--model-path",
            default=SHIPPED_MODEL,
            help="HF-format DeepSeek-V3 directory (default: the shipped tiny checkpoint)",
        )
        a("--tokenizer-path", default=None, help="tokenizer directory (default: model path)")
        a("--served-model-name", default=None, help="model name reported by the API")
        a("--host", default=d["host"].default, help="HTTP host")
        a("--port", type=int, default=d["port"].default, help="HTTP port")
        a(
            "--device",
            default="auto",
            choices=["auto", "cpu", "cuda", "npu"],
            help="auto picks npu, then cuda, then cpu",
        )
        a(
            "--dtype",
            default="auto",
            choices=["auto", "bfloat16", "float16", "float32"],
            help="weights/activations dtype (auto: the checkpoint's, bf16 for the shipped one)",
        )
        a(
            "--context-length",
            type=int,
            default=None,
            help="max tokens per request (prompt + output); default: the model's",
        )
        a("--random-seed", type=int, default=0, help="seed for unseeded sampling")
        a(
            "--log-level",
            default="info",
            choices=["debug", "info", "warning", "error", "critical"],
            help="logging level",
        )
        add_quantization_flags(parser, d)
        add_api_flags(parser, d)
        add_scheduling_flags(parser, d)
        add_disaggregation_flags(parser, d)
        add_overlap_flags(parser, d)
        add_parallel_flags(parser, d)
        add_constrained_flags(parser, d)
        add_speculative_flags(parser, d)
        add_graph_flags(parser, d)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        if kwargs.get("cuda_graph_bs") is not None:
            kwargs["cuda_graph_bs"] = tuple(kwargs["cuda_graph_bs"])
        return cls(**kwargs)


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parses argv; a bad setting is one line on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog="srt_ascend.launch_server")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
        raise  # unreachable: parser.exit exits
