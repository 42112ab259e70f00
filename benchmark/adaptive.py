"""Adaptive draft length and block verification, side by side in one run.

    python benchmark/adaptive.py [--sglang-python .venv-sglang/bin/python]
        [--configs off mtp-k1 ...] [--max-concurrency 1 4 16] [--num-prompts 32]
        [--output-len 64] [--output-len-spread 0.5] [--repeats 1] [--warm-runs 0]
        [--dataset heldout|random-ids] [--input-len 128]
        [--accept-prompts 16] [--json-out FILE] [--plot FILE.png] [--skip-serving] [--skip-accept]

Part 1 (`sglang.bench_serving`, held-out text or `--dataset random-ids`, servers as in
benchmark/serving.py): MTP off,
fixed K = 1, 2, 3, and `--speculative-adaptive` with K up to 3, each at every concurrency
(the names with `-serial`: the same with `--disable-overlap-schedule`); a fresh server per
configuration and repeat, timed cold unless `--warm-runs N` runs each concurrency N times
untimed first (new batch shapes cost most at their first use on a CPU);
the adaptive server's chosen-K histogram, step costs, catch-up passes (count, positions,
seconds), plan fit and acceptance per position come from /server_info (cumulative).
Part 2 (in-process Engine, held-out text, seeded sampling): mean accept length of token-wise
rejection sampling vs block verification (`--speculative-accept-method block`) at
temperature 0.7 and 1.0 for K = 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import os

from serving import aggregate, bench, print_table, result_row, server_state, start_server
from spec_decode import accept_length
from spec_decode import prompts as heldout_prompts

from srt_ascend import Engine
from srt_ascend.server_args import SHIPPED_MODEL

MTP = ["--speculative-algorithm", "MTP"]
CONFIGS = {
    "off": [],
    **{f"mtp-k{k}": [*MTP, "--speculative-num-steps", str(k)] for k in (1, 2, 3)},
    "adaptive-k3": [*MTP, "--speculative-num-steps", "3", "--speculative-adaptive"],
}
# the serial loop beside the default (overlapped rounds): adaptive K overlaps since 2026-12-02
SERIAL = ["--disable-overlap-schedule"]
CONFIGS.update({f"{name}-serial": [*args, *SERIAL] for name, args in list(CONFIGS.items())})


def serving_runs(a) -> list[dict]:
    """One row per (repeat, config, concurrency), with the adaptive server's state."""
    runs = []
    for rep in range(a.repeats):  # round-robin: this VM's speed drifts over minutes
        for name in a.configs:
            args = CONFIGS[name]
            proc, url = start_server(a.model_path, args + a.extra_server_args.split())
            try:
                for c in a.max_concurrency:
                    for _ in range(a.warm_runs):  # shapes and costs seen once first
                        bench(a.sglang_python, url, a.model_path, a, c)
                    r = bench(a.sglang_python, url, a.model_path, a, c)
                    state = server_state(url)
                    row = result_row(name, c, rep, r, state)
                    if "spec_step_cost_seconds" in state:  # cumulative over the server's life
                        row["chosen_k"] = state["spec_draft_length_steps"]
                        row["step_cost_ms"] = {
                            b: {k: round(1e3 * s, 1) for k, s in costs.items()}
                            for b, costs in state["spec_step_cost_seconds"].items()
                        }
                        # the catch-ups (one per switch from K = 0 to drafts), each K's fit
                        # to what the policy expected, acceptance per position
                        row["catch_up"] = {
                            key.removeprefix("spec_catch_up_"): state[key]
                            for key in state
                            if key.startswith("spec_catch_up_")
                        }
                        row["plan_fit"] = state.get("spec_plan_fit")
                        row["acceptance"] = state.get("spec_acceptance_per_position")
                    print(json.dumps(row), flush=True)
                    runs.append(row)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    if getattr(a, "_heldout_file", None):
        os.unlink(a._heldout_file)
    return runs


def accept_rows(a) -> list[dict]:
    ps = heldout_prompts(a.accept_prompts)
    rows = []
    for k in (2, 3):
        for temperature in (0.7, 1.0):
            for method in ("token", "block"):
                engine = Engine(
                    model_path=a.model_path,
                    speculative_algorithm="MTP",
                    speculative_num_steps=k,
                    speculative_accept_method=method,
                )
                try:
                    params = [
                        {
                            "max_new_tokens": a.output_len,
                            "temperature": temperature,
                            "ignore_eos": True,
                            "seed": i,
                        }
                        for i in range(len(ps))
                    ]
                    acc = accept_length(engine.generate(ps, params))
                finally:
                    engine.shutdown()
                row = dict(k=k, temperature=temperature, method=method, accept_length=acc)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def print_accept_table(rows: list[dict]) -> None:
    print("\n| K | temperature | token-wise accept length | block accept length | gain |")
    print("| --- | --- | --- | --- | --- |")
    by = {(r["k"], r["temperature"], r["method"]): r["accept_length"] for r in rows}
    for k, t in dict.fromkeys((r["k"], r["temperature"]) for r in rows):
        tok, blk = by[k, t, "token"], by[k, t, "block"]
        print(f"| {k} | {t} | {tok:.3f} | {blk:.3f} | {blk - tok:+.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sglang-python", default=os.environ.get("SRT_SGLANG_PYTHON", ".venv-sglang/bin/python")
    )
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="output lengths uniform in [L(1-S), L(1+S)] per prompt (0: all L, so requests "
        "decoded in lockstep finish together and their successors prefill in one batch)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--warm-runs",
        type=int,
        default=0,
        help="untimed bench runs per concurrency before the timed one, on each fresh server "
        "(0: cold servers, as the records before 2026-12-08)",
    )
    p.add_argument(
        "--dataset",
        choices=["heldout", "random-ids"],
        default="heldout",
        help="part 1's prompts: held-out text, or random token ids of --input-len tokens "
        "(decoded greedily the model repeats itself: drafts are accepted about as on code)",
    )
    p.add_argument("--input-len", type=int, default=128, help="random-ids prompt length")
    p.add_argument("--accept-prompts", type=int, default=16)
    p.add_argument("--extra-server-args", default="")
    p.add_argument("--skip-serving", action="store_true", help="only part 2")
    p.add_argument("--skip-accept", action="store_true", help="only part 1")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG: TPOT per concurrency and config")
    a = p.parse_args()
    runs = [] if a.skip_serving else serving_runs(a)
    serving = aggregate(runs) if runs else []
    if serving:
        print_table(serving)
    accept = [] if a.skip_accept else accept_rows(a)
    if accept:
        print_accept_table(accept)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"serving": serving, "runs": runs, "accept": accept}, f, indent=1)
    if a.plot and serving:
        plot(serving, a.plot)


def plot(rows: list[dict], path: str) -> None:
    """TPOT and output throughput against concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in CONFIGS:
        sel = [r for r in rows if r["config"] == name]
        conc = [r["max_concurrency"] for r in sel]
        style = ":" if name == "off" else "-" if name.startswith("adaptive") else "--"
        for ax, key in zip(axes, ("median_tpot_ms", "output_throughput")):
            ax.plot(conc, [r[key] for r in sel], style, marker="o", label=name)
    axes[0].set(xscale="log", xlabel="max concurrency", ylabel="median TPOT (ms)")
    axes[1].set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s")
    axes[0].legend(fontsize=7)
    fig.suptitle("MTP off, fixed K and adaptive K (bench_serving, held-out text)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
