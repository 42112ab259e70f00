"""ServerArgs: one frozen config, parsed from SGLang's flag names."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

SHIPPED_MODEL = os.path.join(os.path.dirname(__file__), "checkpoints", "deepseek-v3-tiny-mtp")
MAX_SPEC_STEPS = 15  # FIA's 16-query-token limit per request: 1 + K <= 16
ATTENTION_BACKENDS = ("torch_native", "triton")
# --attention-backend when the flag is not given, by platform name (others: torch_native)
DEFAULT_ATTENTION_BACKEND = {"cuda": "triton"}
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
# --moe-a2a-backend values served here. "none" (SGLang's default and meaning): torch.distributed's
# all-gather + all-reduce (every rank already holds, or gathers, all tokens). "all_to_all" (ours,
# not an SGLang value): torch.distributed's all-to-all sends each token to its experts' ranks,
# under expert parallelism with DP attention. SGLang's other values (deepep mooncake nixl mori
# ascend_fuseep flashinfer) are vendor all-to-all libraries, not available here.
MOE_A2A_BACKENDS = ("none", "all_to_all")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
# --grammar-backend values served here: xgrammar (SGLang's default). SGLang's outlines,
# llguidance and none are not available.
GRAMMAR_BACKENDS = ("xgrammar",)
# Fields holding secrets: never returned by an endpoint nor logged (`ServerArgs.redacted`).
SECRET_FIELDS = ("api_key", "admin_api_key")
REDACTED = "****"


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = SHIPPED_MODEL
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
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

    def __post_init__(self) -> None:
        self.check()

    def redacted(self) -> dict:
        """Every field as a dict, each set secret (SECRET_FIELDS) replaced by REDACTED; an
        unset one stays None, so a reader still sees whether a key is configured. What
        /server_info returns (SGLang's redaction)."""
        info = dataclasses.asdict(self)
        for name in SECRET_FIELDS:
            if info[name] is not None:
                info[name] = REDACTED
        return info

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * (1 << 20))

    @property
    def attn_dp_size(self) -> int:
        """Data-parallel attention groups (1 without --enable-dp-attention)."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one DP group's attention heads (and the vocabulary)."""
        return self.tp_size // self.attn_dp_size

    @property
    def spec_enabled(self) -> bool:
        return self.speculative_algorithm is not None

    def attention_backend_on(self, platform_name: str) -> str:
        """The attention backend to build on that platform: the flag's value, else the
        platform's default (triton on CUDA, torch_native elsewhere)."""
        if self.attention_backend is not None:
            return self.attention_backend
        return DEFAULT_ATTENTION_BACKEND.get(platform_name, "torch_native")

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

    def graphs_enabled(self, platform) -> bool:
        """Graphs are on by default where the platform has real ones (CUDA, NPU); on CPU
        only with --enable-cpu-graph or --enable-torch-compile (which compiles the graph
        runner's forwards); never with --disable-cuda-graph, nor with --moe-a2a-backend
        all_to_all (its split sizes are host integers read per MoE layer). Under
        data-parallel attention every rank replays the same graph (model_executor/dp_graph)."""
        if self.disable_cuda_graph or self.moe_a2a_backend == "all_to_all":
            return False
        return platform.graphs_by_default or self.enable_cpu_graph or self.enable_torch_compile

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
        if not self.shutdown_timeout >= 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if not self.request_read_timeout > 0:
            raise ValueError("--request-read-timeout must be > 0")
        if self.api_key == "" or self.admin_api_key == "":
            raise ValueError("--api-key and --admin-api-key must not be empty")
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
        self._check_sglang_features()
        self._check_parallel()
        self._check_disaggregation()
        if self.spec_enabled:
            self._check_speculative()

    def _check_sglang_features(self) -> None:
        """SGLang flags whose other values or features this server lacks: one line naming
        the flag."""
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"--grammar-backend {self.grammar_backend!r} is not available here "
                f"(accepted: {', '.join(GRAMMAR_BACKENDS)})"
            )
        if self.enable_custom_logit_processor:
            raise ValueError(
                "--enable-custom-logit-processor is not supported: this server does not run "
                "user-supplied logit processors (SGLang's custom_logit_processor and "
                "custom_params request fields are refused with HTTP 400)"
            )

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep-size must be 1 or --tp-size ({self.tp_size}): experts are partitioned "
                f"over the tensor-parallel ranks, got {self.ep_size}"
            )
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"--nnodes ({self.nnodes}) must be >= 1 and divide --tp-size ({self.tp_size})"
            )
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                "--dp-size > 1 needs --enable-dp-attention (for data-parallel replicas run "
                "several servers behind sglang-router)"
            )
        if self.tp_size % self.dp_size:
            raise ValueError(
                f"--dp-size ({self.dp_size}) must divide --tp-size ({self.tp_size}): each DP "
                "group's attention runs on tp/dp ranks"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"unknown --load-balance-method {self.load_balance_method!r} "
                f"({', '.join(LOAD_BALANCE_METHODS)})"
            )
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(
                f"--moe-a2a-backend {self.moe_a2a_backend!r} is not available here (accepted: "
                f"{', '.join(MOE_A2A_BACKENDS)}: torch.distributed's collectives; SGLang's vendor "
                "all-to-all libraries are not)"
            )
        if self.moe_a2a_backend == "all_to_all" and (self.ep_size == 1 or self.attn_dp_size == 1):
            raise ValueError(
                "--moe-a2a-backend all_to_all needs --ep-size > 1 and --enable-dp-attention "
                "--dp-size > 1 (without DP attention every rank already holds every token: "
                "nothing to dispatch)"
            )
        if self.dist_timeout is not None and self.dist_timeout < 1:
            raise ValueError("--dist-timeout must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")

    @property
    def disaggregated(self) -> bool:
        """A prefill or decode server of a disaggregated pair (not `null`)."""
        return self.disaggregation_mode != "null"

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend != "mooncake":
            raise ValueError(
                f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend!r} is "
                "not available here (accepted: mooncake)"
            )
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("--disaggregation-bootstrap-port must be in [1, 65535]")
        if self.disaggregation_timeout <= 0:
            raise ValueError("--disaggregation-timeout must be > 0")
        if not self.disaggregated:
            return
        if self.enable_dp_attention:
            raise ValueError(
                "--disaggregation-mode cannot be combined with --enable-dp-attention (yet)"
            )

    def _check_speculative(self) -> None:
        if self.speculative_algorithm != "MTP":
            raise ValueError(
                f"unknown --speculative-algorithm {self.speculative_algorithm!r} (supported: MTP)"
            )
        k = self.speculative_num_steps
        if not 1 <= k <= MAX_SPEC_STEPS:
            raise ValueError(f"--speculative-num-steps must be in [1, {MAX_SPEC_STEPS}], got {k}")
        n = self.speculative_num_draft_tokens
        if n is not None and n != k + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = {k + 1} "
                f"(chains only), got {n}"
            )
        if self.speculative_eagle_topk != 1:
            raise ValueError("--speculative-eagle-topk must be 1: MTP drafts a single chain")
        if self.speculative_verify not in (None, "expand", "fia"):
            raise ValueError("--speculative-verify must be 'expand' or 'fia'")
        if self.speculative_adaptive and self.tp_size > 1:
            raise ValueError(
                "--speculative-adaptive needs --tp-size 1: it chooses K from this process's "
                "step times, which the ranks would not agree on"
            )
        if self.speculative_accept_method not in ("token", "block"):
            raise ValueError(
                f"--speculative-accept-method must be token or block, "
                f"got {self.speculative_accept_method!r}"
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
        a(
            "--api-key",
            default=None,
            help="require 'Authorization: Bearer KEY' on every endpoint but /health*, /metrics",
        )
        a(
            "--admin-api-key",
            default=None,
            help="key for the admin endpoints (/flush_cache); when set they "
            "do not accept --api-key",
        )
        a(
            "--max-request-body-mb",
            type=float,
            default=d["max_request_body_mb"].default,
            help="largest request body accepted (MiB); larger ones get HTTP 413",
        )
        a(
            "--request-read-timeout",
            type=float,
            default=d["request_read_timeout"].default,
            help="seconds a client has to send a whole request (headers and body) once its "
            "connection opens or its request starts; slower ones are disconnected",
        )
        a(
            "--max-queued-requests",
            type=int,
            default=None,
            help="requests allowed to wait beyond --max-running-requests; more get HTTP 503 "
            "(default: no limit)",
        )
        a(
            "--max-prompts-per-request",
            type=int,
            default=d["max_prompts_per_request"].default,
            help="generations one request may ask for (prompts of a batch times n); more get "
            "HTTP 400",
        )
        a(
            "--shutdown-timeout",
            type=float,
            default=d["shutdown_timeout"].default,
            help="on SIGTERM/SIGINT, seconds to let running requests finish before the rest "
            "are aborted (finish_reason abort) and the process exits",
        )
        a(
            "--max-running-requests",
            type=int,
            default=d["max_running_requests"].default,
            help="max requests in the running batch",
        )
        a(
            "--max-total-tokens",
            type=int,
            default=None,
            help="KV pool size in tokens (overrides --mem-fraction-static)",
        )
        a(
            "--mem-fraction-static",
            type=float,
            default=d["mem_fraction_static"].default,
            help="fraction of device (CPU: system) memory for the KV pool",
        )
        a(
            "--chunked-prefill-size",
            type=int,
            default=d["chunked_prefill_size"].default,
            help="max prefill tokens per forward; -1 disables chunking",
        )
        a(
            "--page-size",
            type=int,
            default=None,
            help="KV pool page size in tokens (default: 128 on NPU, FIA's block size; else 1)",
        )
        a("--disable-radix-cache", action="store_true", help="no prefix sharing")
        a(
            "--schedule-policy",
            default="fcfs",
            choices=["fcfs", "lpm"],
            help="waiting-queue order: first come first served, or longest prefix match",
        )
        a(
            "--attention-backend",
            default=None,
            choices=list(ATTENTION_BACKENDS),
            help="attention kernels (default: triton on CUDA, torch_native on CPU and NPU)",
        )
        a(
            "--num-threads",
            type=int,
            default=None,
            help="CPU: torch intra-op threads (default: torch's); compiled forwards run with "
            "at most one fewer than the process's cores, leaving one to its other threads",
        )
        a(
            "--cpu-small-gemm",
            default="auto",
            choices=["auto", "on", "off"],
            help="CPU: run bf16/fp16 matmuls of at most 2^18 multiply-adds through MKL instead "
            "of oneDNN, whose fixed per-call cost dominates them (auto: on where torch has MKL)",
        )
        a(
            "--enable-deterministic-inference",
            action="store_true",
            help="batch-invariant kernels: every position's result depends on its token prefix "
            "alone, so outputs do not change with batch composition, chunked prefill, radix "
            "hits, graphs or speculation (MTP on or off); CPU only (refused elsewhere)",
        )
        a(
            "--stream-interval",
            type=int,
            default=1,
            help="stream every N tokens (the first at once, the rest with the finish)",
        )
        a(
            "--decode-log-interval",
            type=int,
            default=d["decode_log_interval"].default,
            help="log SGLang's 'Decode batch.' line every N decode steps",
        )
        a(
            "--enable-metrics",
            action="store_true",
            help="accepted for SGLang's scripts: /metrics is always served",
        )
        a(
            "--enable-cache-report",
            action="store_true",
            help="accepted for SGLang's scripts: usage always reports cached tokens",
        )
        a(
            "--kv-invariant-check",
            default="log",
            choices=["log", "fatal"],
            help="when the scheduler goes idle it checks that every KV slot and request row is "
            "free or owned by the prefix cache; log a mismatch, or stop the scheduler (tests)",
        )
        a(
            "--disaggregation-mode",
            default="null",
            choices=list(DISAGGREGATION_MODES),
            help="prefill-decode disaggregation behind sglang-router --pd-disaggregation: "
            "prefill (computes prompts, sends their KV), decode (receives it, generates), or "
            "null (both, one server)",
        )
        a(
            "--disaggregation-transfer-backend",
            default="mooncake",
            help="how KV moves between the servers: mooncake (Mooncake's transfer engine; pip "
            "install srt-ascend[pd])",
        )
        a(
            "--disaggregation-bootstrap-port",
            type=int,
            default=d["disaggregation_bootstrap_port"].default,
            help="prefill server: the port of its bootstrap endpoint, where decode servers "
            "say where a request's KV goes (give the router the same port)",
        )
        a(
            "--disaggregation-ib-device",
            default=None,
            help="RDMA device(s) for the transfer engine, e.g. mlx5_0; none: TCP",
        )
        a(
            "--disaggregation-timeout",
            type=float,
            default=d["disaggregation_timeout"].default,
            help="seconds a disaggregated request waits for its peer (the decode server's "
            "registration on the prefill side, the KV on the decode side) before it fails",
        )
        a(
            "--disable-overlap-schedule",
            action="store_true",
            help="run each decode step's forward after the previous step's results are "
            "committed (the serial loop) instead of overlapping them",
        )
        a(
            "--enable-overlap-schedule",
            action="store_true",
            help="overlap decode steps where the platform runs them serially by default "
            "(eager forwards on CPU, which hold the GIL op by op)",
        )
        a(
            "--tp-size",
            "--tensor-parallel-size",
            dest="tp_size",
            type=int,
            default=1,
            help="tensor-parallel ranks: one scheduler/model process each (attention heads, "
            "MLP and expert intermediate rows, vocabulary split across them)",
        )
        a(
            "--ep-size",
            "--expert-parallel-size",
            dest="ep_size",
            type=int,
            default=1,
            help="expert parallelism: 1, or --tp-size to partition the routed experts over "
            "the tensor-parallel ranks (each holds whole experts; the shared expert is "
            "replicated) instead of splitting every expert's intermediate rows",
        )
        a(
            "--dist-init-addr",
            "--nccl-init-addr",
            dest="dist_init_addr",
            default=None,
            help="HOST:PORT where the ranks meet (torch.distributed TCP rendezvous on node 0; "
            "default: a free port on 127.0.0.1, one node only)",
        )
        a("--nnodes", type=int, default=1, help="nodes the --tp-size ranks are spread over")
        a(
            "--enable-dp-attention",
            action="store_true",
            help="data-parallel attention: the --tp-size ranks form --dp-size groups, each "
            "scheduling its own requests with attention split over tp/dp ranks; MoE and MLP "
            "layers run over every group's tokens on all ranks (graphs: every rank replays "
            "the same bucket, padded)",
        )
        a(
            "--dp-size",
            "--data-parallel-size",
            dest="dp_size",
            type=int,
            default=1,
            help="data-parallel attention groups (needs --enable-dp-attention; divides --tp-size)",
        )
        a(
            "--load-balance-method",
            default="round_robin",
            choices=list(LOAD_BALANCE_METHODS),
            help="which DP group a new request goes to: in turn, or the one with the fewest "
            "requests",
        )
        a(
            "--moe-a2a-backend",
            default="none",
            help="expert-parallel token dispatch/combine over torch.distributed: none "
            "(all-gather + all-reduce) or all_to_all (each token to its experts' ranks; needs "
            "--ep-size > 1 and --enable-dp-attention; runs eagerly: graphs off); SGLang's "
            "vendor all-to-all backends are not available here",
        )
        a(
            "--node-rank",
            type=int,
            default=0,
            help="this node's index (0: the node that serves HTTP; others run ranks only)",
        )
        a(
            "--dist-timeout",
            type=int,
            default=d["dist_timeout"].default,
            help="seconds a torch.distributed collective (and the rendezvous) waits for a "
            "peer before the server ends; longer than the slowest rank's model load",
        )
        a(
            "--constrained-json-disable-any-whitespace",
            action="store_true",
            help="JSON-schema outputs are compact (no whitespace between JSON tokens) instead "
            "of allowing any whitespace there",
        )
        a(
            "--grammar-backend",
            default=d["grammar_backend"].default,
            help="constrained-generation backend: xgrammar (the only one here; SGLang's "
            "outlines, llguidance and none are refused)",
        )
        a(
            "--enable-custom-logit-processor",
            action="store_true",
            help="refused (one error line): user-supplied logit processors (SGLang's "
            "custom_logit_processor / custom_params) are not supported by this server",
        )
        a(
            "--constrained-json-max-whitespace-cnt",
            type=int,
            default=d["constrained_json_max_whitespace_cnt"].default,
            help="most consecutive whitespace characters between JSON tokens of a JSON-schema "
            "output (0: unbounded, SGLang's default; a small model otherwise pads with "
            "whitespace until its token limit)",
        )
        a(
            "--grammar-compile-timeout",
            type=float,
            default=d["grammar_compile_timeout"].default,
            help="seconds a request's grammar may compile; a longer one is stopped and the "
            "request refused (400)",
        )
        a(
            "--grammar-max-size",
            type=int,
            default=d["grammar_max_size"].default,
            help="most characters in a request's grammar (regex, json_schema, ebnf, "
            "structural_tag); a longer one is refused (400) before compiling",
        )
        a("--speculative-algorithm", default=None, help="MTP to enable speculative decoding")
        a("--speculative-num-steps", type=int, default=1, help="draft tokens per step K (1-15)")
        a(
            "--speculative-num-draft-tokens",
            type=int,
            default=None,
            help="tokens verified per request per step; must be K + 1",
        )
        a("--speculative-eagle-topk", type=int, default=1, help="must be 1 (chains only)")
        a(
            "--speculative-verify",
            default=None,
            choices=["expand", "fia"],
            help="verify by batch expansion or by one multi-query FIA forward (default: fia; on "
            "NPU fia where the model's shape fits the op, else expand)",
        )
        a(
            "--speculative-accept-method",
            default="token",
            choices=["token", "block"],
            help="how sampled drafts are accepted: token-wise rejection sampling, or block "
            "verification (Sun et al. 2025: lossless, accepts at least as many in expectation)",
        )
        a(
            "--speculative-adaptive",
            action="store_true",
            help="choose the drafts per step (0..--speculative-num-steps) from the batch size, "
            "each request's recent acceptance per draft position and the measured step cost",
        )
        a(
            "--disable-cuda-graph",
            action="store_true",
            help="run decode, verify and MTP draft forwards eagerly (graphs are on by default "
            "on CUDA and NPU)",
        )
        a(
            "--enable-cpu-graph",
            action="store_true",
            help="on CPU, run those forwards through the graph runner's eager replay over "
            "static buffers (exercises capture/pad/replay; no speed-up on CPU)",
        )
        a(
            "--cuda-graph-bs",
            "--graph-batch-sizes",
            dest="cuda_graph_bs",
            type=int,
            nargs="+",
            default=None,
            help="batch-size buckets to capture (default 1 2 4 8 12 16 24 32, then multiples "
            "of 16, up to --cuda-graph-max-bs)",
        )
        a(
            "--cuda-graph-max-bs",
            type=int,
            default=32,
            help="largest captured batch size; bigger batches run eagerly",
        )
        a(
            "--enable-torch-compile",
            action="store_true",
            help="compile the graph runner's decode, verify and MTP draft forwards with "
            "torch.compile (inductor; on CPU the C++ wrapper, on CUDA inside CUDA graphs); "
            "artifacts cached in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/srt_ascend/inductor)",
        )
        a(
            "--torch-compile-max-bs",
            type=int,
            default=32,
            help="largest batch-size bucket that is compiled; bigger buckets are captured "
            "uncompiled",
        )
        a(
            "--torch-compile-at-start",
            action="store_true",
            help="with --enable-torch-compile, compile every shape before serving; by default "
            "the server serves at once (uncompiled) and compiles one shape at a time while it "
            "has no request, progress in /server_info",
        )

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
