"""`python -m sglang.bench_serving --backend sglang` against srt_ascend servers, one run.

    python benchmark/serving.py [--sglang-python .venv-sglang/bin/python]
        [--configs off mtp-k1-expand mtp-k2-fia ...] [--max-concurrency 1 4 16 | --saturate]
        [--num-prompts 32] [--repeats 1] [--input-len 128] [--output-len 128] [--json-out FILE]

Each configuration gets its own server (shipped checkpoint, default bf16) on a free port;
bench_serving runs unmodified with the offline `random-ids` dataset (or `--dataset heldout`:
held-out stdlib snippets written as a local ShareGPT-format file) and the shipped tokenizer.
`--saturate` sends every request at once (request rate inf, no concurrency cap).
`--repeats N` runs every configuration N times round-robin and reports medians (this VM's
speed drifts by 20-40% over minutes: interleaving keeps the ratios fair). Reported per
run: request and output throughput, median TTFT and TPOT, and (MTP) the server's mean accept
length from /server_info. A configuration name ending in `@onednn` adds `--cpu-small-gemm off`,
one ending in `@serial` adds `--disable-overlap-schedule`, one ending in `@t1` / `@t2`
`--num-threads 1` / `2` (the default leaves a core: benchmark/README.md "Eager OpenMP
threads").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from plots import plot_spec_rows
from spec_decode import prompts as heldout_prompts

from srt_ascend.server_args import SHIPPED_MODEL

CONFIGS = {
    "off": [],
    **{
        f"mtp-k{k}-{v}": [
            "--speculative-algorithm",
            "MTP",
            "--speculative-num-steps",
            str(k),
            "--speculative-verify",
            v,
        ]
        for k in (1, 2, 3)
        for v in ("expand", "fia")
    },
}
# "<config>@onednn": the same server with --cpu-small-gemm off (every bf16 matmul via oneDNN).
CONFIGS.update(
    {f"{name}@onednn": [*args, "--cpu-small-gemm", "off"] for name, args in CONFIGS.items()}
)
# "<config>@serial": the same server with --disable-overlap-schedule (the serial step loop).
CONFIGS.update(
    {f"{name}@serial": [*args, "--disable-overlap-schedule"] for name, args in CONFIGS.items()}
)
# "<config>@t<N>": the same server with --num-threads N.
CONFIGS.update(
    {
        f"{name}@t{n}": [*args, "--num-threads", str(n)]
        for name, args in list(CONFIGS.items())
        for n in (1, 2)
    }
)


def server_state(url: str) -> dict:
    """The scheduler's internal state from /server_info (counters since the server started)."""
    info = json.load(urllib.request.urlopen(url + "/server_info"))
    return info.get("internal_states", [{}])[0]


def result_row(name: str, c: int | None, rep: int, r: dict, state: dict) -> dict:
    """One table row from a bench_serving result and the server's state after it."""
    acc = state.get("avg_spec_accept_length")
    return dict(
        config=name,
        max_concurrency=c or "inf",
        repeat=rep,
        completed=r["completed"],
        request_throughput=round(r["request_throughput"], 3),
        output_throughput=round(r["output_throughput"], 1),
        median_ttft_ms=round(r["median_ttft_ms"], 1),
        median_tpot_ms=round(r["median_tpot_ms"], 2),
        accept_length=round(acc, 3) if acc else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str, extra: list[str], prefix: list[str] = ()
) -> tuple[subprocess.Popen, str]:
    """A server on a free port, returned once it serves with every graph compiled (with
    --enable-torch-compile it serves before: the measured runs must not compile). `prefix`
    goes before the command (e.g. `taskset -c 0`)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "srt_ascend.launch_server",
            "--model-path",
            model,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            wait_compiled(url)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def wait_compiled(url: str) -> None:
    """Until /server_info reports every graph compiled (at once without compiling)."""
    while not server_state(url).get("torch_compile", {}).get("ready", True):
        time.sleep(1)


def bench(
    py: str, url: str, model: str, a, concurrency: int | None, extra_body: dict | None = None
) -> dict:
    """One bench_serving run; `extra_body` is merged into every request body (bench_serving's
    --extra-request-body: e.g. sampling_params with a json_schema)."""
    out = tempfile.mktemp(suffix=".jsonl")
    port = url.rsplit(":", 1)[1]
    cmd = [
        py,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--model",
        model,
        "--tokenizer",
        model,
        *dataset_args(a),
        "--num-prompts",
        str(a.num_prompts),
        "--request-rate",
        "inf",
        "--output-file",
        out,
        "--seed",
        "1",
        "--disable-tqdm",
    ]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    if extra_body:
        cmd += ["--extra-request-body", json.dumps(extra_body)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out) as f:
        res = json.loads(f.read().strip().splitlines()[-1])
    os.unlink(out)
    return res


def dataset_args(a) -> list[str]:
    """bench_serving's dataset flags: random token ids, or held-out text as a local
    ShareGPT-format file (prompt = snippet; output length fixed, or with --output-len-spread S
    drawn per prompt from [L(1-S), L(1+S)] with a fixed seed, the same in every config: a
    filler answer of that many tokens, which bench_serving counts as the output length)."""
    if a.dataset == "random-ids":
        return [
            "--dataset-name",
            "random-ids",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
            "--random-range-ratio",
            "1.0",
        ]
    spread = getattr(a, "output_len_spread", 0.0)
    if not getattr(a, "_heldout_file", None):
        answers = ["-"] * a.num_prompts
        if spread:
            answers = filler_answers(a.model_path, a.output_len, spread, a.num_prompts)
        rows = [
            {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": ans}]}
            for text, ans in zip(heldout_prompts(a.num_prompts), answers)
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(rows, f)
        a._heldout_file = f.name
    args = ["--dataset-name", "sharegpt", "--dataset-path", a._heldout_file]
    return args if spread else [*args, "--sharegpt-output-len", str(a.output_len)]


def filler_answers(model_path: str, length: int, spread: float, n: int) -> list[str]:
    """n answers whose token counts (as bench_serving encodes them, BOS included) are drawn
    uniformly from [length(1-spread), length(1+spread)] (seed 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(0)
    lo, hi = round(length * (1 - spread)), round(length * (1 + spread))
    out = []
    for _ in range(n):
        want = rng.randint(max(lo, 4), hi)
        words = want
        while len(tokenizer.encode(" the" * words)) > want:
            words -= 1
        out.append(" the" * words)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sglang-python", default=os.environ.get("SRT_SGLANG_PYTHON", ".venv-sglang/bin/python")
    )
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--configs", nargs="+", default=["off"], choices=list(CONFIGS), metavar="CFG")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--saturate", action="store_true", help="all requests at once")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run all configs this many times round-robin; report medians over the repeats",
    )
    p.add_argument(
        "--dataset",
        default="random-ids",
        choices=["random-ids", "heldout"],
        help="heldout: held-out stdlib snippets as a local ShareGPT-format file",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="held-out text: output lengths uniform in [L(1-S), L(1+S)] per prompt (0: all L)",
    )
    p.add_argument("--extra-server-args", default="", help="e.g. '--dtype float32'")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG: TPOT and accept length vs K (matplotlib)")
    p.add_argument("--from-json", default=None, help="only print/plot the rows of this file")
    a = p.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            rows = json.load(f)
        print_table(rows)
        if a.plot:
            plot(rows, a.plot)
        return
    levels = [None] if a.saturate else a.max_concurrency
    runs = []
    for rep in range(a.repeats):  # round-robin: slow phases of this VM hit every config alike
        for name in a.configs:
            proc, url = start_server(a.model_path, CONFIGS[name] + a.extra_server_args.split())
            try:
                for c in levels:
                    r = bench(a.sglang_python, url, a.model_path, a, c)
                    row = result_row(name, c, rep, r, server_state(url))
                    runs.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    rows = aggregate(runs)
    if getattr(a, "_heldout_file", None):
        os.unlink(a._heldout_file)
    print_table(rows)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:
        plot(rows, a.plot)


def plot(rows: list[dict], path: str) -> None:
    plot_spec_rows(
        rows, path, "max_concurrency", "median_tpot_ms", "bench_serving TPOT (dotted: MTP off)"
    )


def _median(group: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in group)


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (config, concurrency): medians over the repeats (TPOT of each repeat kept in
    `tpot_runs`); a single repeat passes through unchanged."""
    keys = list(dict.fromkeys((r["config"], r["max_concurrency"]) for r in runs))
    rows = []
    for key in keys:
        group = [r for r in runs if (r["config"], r["max_concurrency"]) == key]
        if len(group) == 1:
            rows.append({k: v for k, v in group[0].items() if k != "repeat"})
            continue

        rows.append(
            dict(
                config=key[0],
                max_concurrency=key[1],
                completed=sum(r["completed"] for r in group),
                request_throughput=round(_median(group, "request_throughput"), 3),
                output_throughput=round(_median(group, "output_throughput"), 1),
                median_ttft_ms=round(_median(group, "median_ttft_ms"), 1),
                median_tpot_ms=round(_median(group, "median_tpot_ms"), 2),
                accept_length=group[-1]["accept_length"],
                tpot_runs=[r["median_tpot_ms"] for r in group],
            )
        )
    return rows


def print_table(rows: list[dict]) -> None:
    off = {r["max_concurrency"]: r["median_tpot_ms"] for r in rows if r["config"] == "off"}
    print(
        "\n| config | max concurrency | completed | output tok/s | median TTFT ms | "
        "median TPOT ms | TPOT speed-up vs off | accept length |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = off.get(r["max_concurrency"])
        speed = f"{base / r['median_tpot_ms']:.2f}x" if base else "-"
        print(
            f"| {r['config']} | {r['max_concurrency']} | {r['completed']} | "
            f"{r['output_throughput']} | {r['median_ttft_ms']} | {r['median_tpot_ms']} | "
            f"{speed} | {r['accept_length'] or '-'} |"
        )


if __name__ == "__main__":
    main()
