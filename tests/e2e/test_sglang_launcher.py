"""`python -m sglang.launch_server --speculative-algorithm MTP` runs srt_ascend's server through
SGLang's plugin entry points (srt_ascend.sglang_plugin); runs in the sglang interpreter."""

from __future__ import annotations

import json
import subprocess

import pytest
from e2e_servers import E2E_MODEL, REPO, child_env, free_port, serving_process


def _launch(sglang_python: str, *args: str) -> list[str]:
    cmd = [sglang_python, "-m", "sglang.launch_server", "--model-path", E2E_MODEL]
    return cmd + ["--speculative-algorithm", "MTP", *args]


def _run(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, *args], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=180
    )


def _translate(python: str, *argv: str) -> tuple[dict, list[str]]:
    """srt_ascend's translation of SGLang's argv (model path added), run where sglang is."""
    code = (
        "import sys, json; from srt_ascend.sglang_plugin import translate;"
        "print(json.dumps(translate(sys.argv[1:])))"
    )
    proc = _run(python, "-c", code, "--model-path", E2E_MODEL, *argv)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sglang_mtp_server(sglang_python, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("sglang_launcher") / "server.log"
    cmd = _launch(sglang_python, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port))
    cmd += ["--dtype", "float32", "--num-threads", "1", "--speculative-num-steps", "2"]
    cmd += ["--enable-two-batch-overlap"]  # an SGLang flag srt_ascend lacks: reported, not fatal
    cmd += ["--cpu-small-gemm", "off"]  # srt_ascend-only: taken out before SGLang parses
    cmd += ["--enable-metrics", "--enable-cache-report", "--decode-log-interval", "7"]
    with serving_process(cmd, f"http://127.0.0.1:{port}", log_path) as server:
        yield server


def test_sglang_launcher_serves_mtp(sglang_mtp_server):
    r = sglang_mtp_server.post(
        "/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        },
    )
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert "spec_accept_length" in meta, meta
    log = sglang_mtp_server.log()
    lines = [line for line in log.splitlines() if "does not support these SGLang flags" in line]
    assert len(lines) == 1 and "--enable-two-batch-overlap" in lines[0], log
    assert "--enable-metrics" not in lines[0] and "--decode-log-interval" not in lines[0]
    info = sglang_mtp_server.get("/server_info").json()
    assert info["cpu_small_gemm"] == "off" and info["decode_log_interval"] == 7


def test_sglang_launcher_device_npu_is_one_line_exit_2(sglang_python):
    proc = _run(*_launch(sglang_python, "--device", "npu", "--port", str(free_port())))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: --device npu" in lines[0], proc.stderr


def test_sglang_launcher_without_mtp_is_untouched(sglang_python):
    """Without MTP the plugin registers nothing: SGLang parses the flags itself."""
    code = (
        "import sys; sys.argv = ['x', '--model-path', 'm'];"
        "from sglang.srt.plugins import load_plugins;"
        "from sglang.srt.plugins.hook_registry import HookRegistry;"
        "load_plugins(); print(sorted(HookRegistry._hooks))"
    )
    proc = subprocess.run(
        [sglang_python, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prepare_server_args" not in proc.stdout, proc.stdout
    assert "torch_npu" not in proc.stdout


def test_sglang_parallelism_flags_pass_through(sglang_python):
    """--tp-size, --dist-init-addr, --nnodes, --node-rank and data-parallel attention's flags
    reach srt_ascend's ServerArgs (`--moe-a2a-backend all_to_all`, srt_ascend's own value, too)."""
    argv = "--tp-size 4 --dist-init-addr 10.0.0.1:5000 --nnodes 2 --node-rank 1".split()
    argv += "--enable-dp-attention --dp-size 2 --moe-a2a-backend all_to_all".split()
    kwargs, unsupported = _translate(sglang_python, *argv)
    assert unsupported == []
    assert (kwargs["tp_size"], kwargs["dist_init_addr"]) == (4, "10.0.0.1:5000")
    assert (kwargs["nnodes"], kwargs["node_rank"]) == (2, 1)
    assert (kwargs["enable_dp_attention"], kwargs["dp_size"]) == (True, 2)
    assert kwargs["moe_a2a_backend"] == "all_to_all"  # a value SGLang's parser does not know


def test_sglang_grammar_backend_passes_through_and_others_exit_2(sglang_python):
    """--grammar-backend reaches srt_ascend's ServerArgs (not the ignored-flags warning);
    a backend this server lacks is one error line, exit 2, as on srt_ascend's own CLI."""
    for name in ("xgrammar", "llguidance"):
        kwargs, unsupported = _translate(sglang_python, "--grammar-backend", name)
        assert kwargs["grammar_backend"] == name and unsupported == []
    proc = _run(
        *_launch(sglang_python, "--grammar-backend", "outlines", "--port", str(free_port()))
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: --grammar-backend 'outlines'" in lines[0], proc.stderr


def test_srt_ascend_bounds_and_sglang_serving_flags_pass_through(sglang_python):
    """The bounds only srt_ascend has are taken out of argv before SGLang's parser sees them
    (it would exit on them); SGLang's --dist-timeout, --constrained-json-max-whitespace-cnt
    and --disable-overlap-schedule map by name."""
    argv = "--request-read-timeout 7 --max-prompts-per-request 9".split()
    argv += "--grammar-compile-timeout 3 --grammar-max-size 1000 --dist-timeout 60".split()
    argv += "--constrained-json-max-whitespace-cnt 4 --disable-overlap-schedule".split()
    kwargs, unsupported = _translate(sglang_python, *argv)
    assert unsupported == []
    assert kwargs["disable_overlap_schedule"] is True
    assert (kwargs["request_read_timeout"], kwargs["max_prompts_per_request"]) == (7, 9)
    assert (kwargs["grammar_compile_timeout"], kwargs["grammar_max_size"]) == (3, 1000)
    assert kwargs["dist_timeout"] == 60
    assert kwargs["constrained_json_max_whitespace_cnt"] == 4


def test_sglang_disaggregation_flags_pass_through(sglang_python):
    """SGLang's prefill-decode disaggregation flags reach srt_ascend's ServerArgs by name;
    --disaggregation-timeout (srt_ascend's) is taken out before SGLang's parser."""
    argv = "--disaggregation-mode prefill --disaggregation-transfer-backend mooncake".split()
    argv += "--disaggregation-bootstrap-port 9001 --disaggregation-ib-device mlx5_0".split()
    argv += "--disaggregation-timeout 5".split()
    kwargs, unsupported = _translate(sglang_python, *argv)
    assert unsupported == []
    assert (kwargs["disaggregation_mode"], kwargs["disaggregation_bootstrap_port"]) == (
        "prefill",
        9001,
    )
    assert kwargs["disaggregation_transfer_backend"] == "mooncake"
    assert kwargs["disaggregation_ib_device"] == "mlx5_0"
    assert kwargs["disaggregation_timeout"] == 5
