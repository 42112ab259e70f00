"""SGLang's own clients, unmodified, against the server: the frontend DSL programs in
python/ (gen with and without streaming, select, fork, run_batch) and
`python -m sglang.bench_serving --backend sglang`. Skipped when sglang is not importable."""

from __future__ import annotations

import json
import subprocess

import pytest

FRONTEND_EXAMPLES = [
    "frontend_gen.py",
    "frontend_constrained.py",
    "frontend_select.py",
    "frontend_fork.py",
    "frontend_run_batch.py",
]


@pytest.fixture(scope="module")
def frontend(sglang_python, run_examples) -> dict:
    """{script: reported JSON} for the DSL examples, run once in one interpreter."""
    return run_examples(sglang_python, FRONTEND_EXAMPLES)


def native_greedy(server, text: str, n: int) -> str:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    return server.post("/generate", json=body).json()["text"]


def test_frontend_gen(server, frontend):
    out = frontend["frontend_gen.py"]
    prompt = "def fibonacci(n):\n"
    assert out["text"] == native_greedy(server, prompt, 16)
    assert out["streamed"] == out["text"]
    assert out["num_pieces"] >= 2
    assert out["full_text"] == prompt + out["text"]
    assert out["meta"]["completion_tokens"] <= 16


def test_frontend_constrained(frontend):
    import re

    out = frontend["frontend_constrained.py"]
    assert re.fullmatch(out["call_regex"], out["call"]), out["call"]
    assert re.fullmatch(r"[-+]?[0-9]+", out["count"].strip()), out["count"]
    assert 1900 <= json.loads(out["year"]) <= 2100
    assert re.fullmatch("[a-z]{2,8}", json.loads(out["name"])), out["name"]


def test_frontend_select(frontend):
    out = frontend["frontend_select.py"]
    scores = out["normalized_prompt_logprobs"]
    assert out["choice"] in out["choices"] and len(scores) == len(out["choices"])
    assert all(s < 0 for s in scores)
    # select's default (token-length-normalised) method takes the best-scoring choice.
    assert out["choices"][scores.index(max(scores))] == out["choice"]


def test_frontend_fork(server, frontend):
    out = frontend["frontend_fork.py"]
    text = out["prompt"]
    for topic in out["topics"]:
        code = native_greedy(server, out["prompt"] + f"# using {topic}\n", 12)
        text += f"# {topic}:\n" + code + "\n"
    assert out["text"] == text + native_greedy(server, text, 8)
    assert out["text"].endswith(out["summary"])


def test_frontend_run_batch(server, frontend):
    out = frontend["frontend_run_batch.py"]
    assert out["batch"] == out["one_by_one"]
    assert out["batch"] == [native_greedy(server, p, 8) for p in out["prompts"]]


def test_bench_serving_random_ids(server, sglang_python, subprocess_env, tmp_path):
    result = tmp_path / "bench.jsonl"
    cmd = [sglang_python, "-m", "sglang.bench_serving", "--backend", "sglang"]
    cmd += ["--base-url", server.url, "--model", server.model_path]
    cmd += ["--tokenizer", server.model_path, "--output-file", str(result), "--output-details"]
    cmd += (
        "--dataset-name random-ids --num-prompts 8 --random-input-len 32 --random-output-len 8 "
        "--random-range-ratio 1.0 --request-rate inf --seed 1 --disable-tqdm"
    ).split()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(result.read_text().strip().splitlines()[-1])
    assert report["backend"] == "sglang"
    assert report["completed"] == 8  # every request succeeded
    assert report["errors"] == [""] * 8
    # Prompt lengths are the server's counts: the random ids are sent as text and re-tokenized.
    assert len(report["input_lens"]) == 8 and all(n > 0 for n in report["input_lens"])
    assert report["output_lens"] == [8] * 8  # bench_serving sends ignore_eos
    assert report["total_output_tokens"] == 64
    assert all(t > 0 for t in report["ttfts"])
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0
    assert report["request_throughput"] > 0
