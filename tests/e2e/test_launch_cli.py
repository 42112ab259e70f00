"""The launch CLI: a setting that makes no sense is a one-line error and exit code 2, not a
traceback; --help documents the flags."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PREFIX = "srt_ascend.launch_server: error: "


def error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="an NPU stack is installed here"
)
def test_missing_npu_is_one_line_exit_2(launch_cli, e2e_model):
    proc = launch_cli("--model-path", e2e_model, "--device", "npu")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(PREFIX + "--device npu: torch_npu")


def test_unknown_speculative_algorithm_exit_2(launch_cli):
    proc = launch_cli("--speculative-algorithm", "FOO")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "srt_ascend.launch_server: error: unknown --speculative-algorithm 'FOO' (supported: MTP)"
    ]


def test_too_many_draft_tokens_exit_2(launch_cli):
    proc = launch_cli("--speculative-algorithm", "MTP", "--speculative-num-steps", "16")
    assert proc.returncode == 2
    assert error_lines(proc) == [PREFIX + "--speculative-num-steps must be in [1, 15], got 16"]


def test_bad_graph_sizes_exit_2(launch_cli):
    proc = launch_cli("--graph-batch-sizes", "0", "4")
    assert proc.returncode == 2
    assert error_lines(proc) == [PREFIX + "--cuda-graph-bs sizes must be >= 1"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (("--grammar-compile-timeout", "0"), "--grammar-compile-timeout must be > 0"),
        (("--grammar-max-size", "0"), "--grammar-max-size must be >= 1"),
        (
            ("--constrained-json-max-whitespace-cnt", "-1"),
            "--constrained-json-max-whitespace-cnt must be >= 0 (0: unbounded)",
        ),
    ],
)
def test_bad_grammar_limits_exit_2(launch_cli, argv, line):
    proc = launch_cli(*argv)
    assert proc.returncode == 2
    assert error_lines(proc) == [PREFIX + line]


def test_two_different_body_bounds_exit_2(launch_cli):
    """--max-payload-size (SGLang's, bytes) and --max-request-body-mb are one bound."""
    proc = launch_cli("--max-payload-size", "1000", "--max-request-body-mb", "2")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        PREFIX + "--max-payload-size 1000 and --max-request-body-mb 2 give two different "
        "request body bounds: give one of them"
    ]


def test_nnodes_without_dist_init_addr_exit_2(launch_cli):
    proc = launch_cli("--tp-size", "2", "--nnodes", "2")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        PREFIX + "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)"
    ]


def test_dp_size_without_dp_attention_exit_2(launch_cli):
    proc = launch_cli("--tp-size", "2", "--dp-size", "2")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        PREFIX + "--dp-size > 1 needs --enable-dp-attention (for data-parallel replicas run "
        "several servers behind sglang-router)"
    ]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ("--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep"),
            "--moe-a2a-backend 'deepep' is not available here (accepted: none, all_to_all: "
            "torch.distributed's collectives; SGLang's vendor all-to-all libraries are not)",
        ),
        (
            ("--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "all_to_all"),
            "--moe-a2a-backend all_to_all needs --ep-size > 1 and --enable-dp-attention "
            "--dp-size > 1 (without DP attention every rank already holds every token: "
            "nothing to dispatch)",
        ),
    ],
    ids=["vendor", "all_to_all-without-dp-attention"],
)
def test_moe_a2a_backend_refused_exit_2(launch_cli, argv, line):
    proc = launch_cli(*argv)
    assert proc.returncode == 2
    assert error_lines(proc) == [PREFIX + line]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ("--grammar-backend", "outlines"),
            "--grammar-backend 'outlines' is not available here (accepted: xgrammar, llguidance)",
        ),
        (
            ("--enable-custom-logit-processor",),
            "--enable-custom-logit-processor is not supported: this server does not run "
            "user-supplied logit processors (SGLang's custom_logit_processor and custom_params "
            "request fields are refused with HTTP 400)",
        ),
    ],
    ids=["grammar-backend", "custom-logit-processor"],
)
def test_sglang_flags_without_a_backend_here_exit_2(launch_cli, argv, line):
    proc = launch_cli(*argv)
    assert proc.returncode == 2
    assert error_lines(proc) == [PREFIX + line]


def test_tp_size_that_does_not_split_the_model_exit_2(launch_cli, e2e_model):
    proc = launch_cli("--model-path", e2e_model, "--device", "cpu", "--tp-size", "3")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(PREFIX + "--tp-size 3 does not divide the model's "), lines
    assert "num_attention_heads 8" in lines[0]


def test_missing_model_path_exit_2(launch_cli, tmp_path):
    proc = launch_cli("--model-path", str(tmp_path / "nope"))
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].endswith("is not a directory")


def test_model_path_without_checkpoint_is_one_line_exit_2(
    launch_cli, tmp_path, e2e_model, free_port
):
    # The tokenizer is there, the weights are not.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(e2e_model) / name).read_bytes())
    proc = launch_cli("--model-path", str(tmp_path), "--device", "cpu", "--port", str(free_port()))
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(PREFIX + f"cannot load the model from {str(tmp_path)!r}")


def test_port_in_use_is_one_line_exit_2(launch_cli, server, e2e_model):
    port = server.url.rsplit(":", 1)[1]
    proc = launch_cli("--model-path", e2e_model, "--port", port)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith(PREFIX + f"cannot listen on 127.0.0.1:{port}")


def test_help_documents_flags(launch_cli):
    proc = launch_cli("--help")
    assert proc.returncode == 0
    for flag in (
        "--model-path",
        "--tokenizer-path",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--served-model-name",
        "--context-length",
        "--max-running-requests",
        "--max-total-tokens",
        "--chunked-prefill-size",
        "--page-size",
        "--disable-radix-cache",
        "--schedule-policy",
        "--tp-size",
        "--dist-init-addr",
        "--nnodes",
        "--node-rank",
        "--enable-dp-attention",
        "--dp-size",
        "--constrained-json-max-whitespace-cnt",
        "--grammar-compile-timeout",
        "--grammar-max-size",
        "--load-balance-method",
        "--moe-a2a-backend",
        "--log-level",
        "--speculative-algorithm",
        "--disable-cuda-graph",
        "--enable-cpu-graph",
        "--cuda-graph-bs",
        "--graph-batch-sizes",
        "--cuda-graph-max-bs",
        "--grammar-backend",
        "--enable-custom-logit-processor",
    ):
        assert flag in proc.stdout
