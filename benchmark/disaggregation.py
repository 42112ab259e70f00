"""Prefill-decode disaggregation: what moving a prompt's KV costs next to computing it, and
TTFT / TPOT under a prefill-heavy mix, 1P1D against one colocated server.

    python benchmark/disaggregation.py [--lengths 128 512 1024 2048 3072] [--repeats 3]
        [--mtp] [--json-out FILE]
    python benchmark/disaggregation.py --mix [--rounds 2] [--duration 30] [--mtp]
        [--colocated-threads N] [--json-out FILE]

One colocated server, and a prefill server + a decode server behind sglang-router
`--pd-disaggregation` (Mooncake's transfer engine over TCP on localhost), all on the
shipped checkpoint (bf16 by default). Per prompt length: a fresh random prompt (no radix
hit) with max_new_tokens 1 to the colocated server (its wall time: the prefill, with HTTP),
another through the router (its wall time: prefill + registration + transfer + the decode
server's first output), and the prefill server's KV bytes and transfer seconds for it (from
/server_info's kv_transfer_* totals). Medians over --repeats.

`--mix`: the same requests (fixed seed) to one colocated server on both cores and to 1P1D
behind the router with the prefill server pinned to core 0 and the decode server to core 1
(`taskset`, `--num-threads 1` each; the router and this client are not pinned). The mix: a
steady stream of decoders (short prompts, long outputs; arrivals with exponential gaps of
mean --decode-every s) and long prompts (--long-prompt tokens, drawn uniformly, short
outputs) arriving every --long-every s (jittered), for --duration s of arrivals, greedy,
ignore_eos, streamed. Per request: TTFT (send to the first chunk with a token) and TPOT
((last - first) / (tokens - 1)); per setup: p50 / p99 of each over the decoders, the long
prompts and all, and output tok/s (tokens / (last finish - first send)). --rounds R runs
the setups alternately (colocated, PD; then PD, colocated; ...), each round with fresh
prompts (no radix hits across rounds), the same for both setups within a round; the table
pools the rounds' requests. The prefill server's kv_transfer_seconds per long prompt is
reported beside, to split PD's TTFT into what the transfer costs and what the rest costs.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

from machine import machine_info
from serving import free_port, server_state, start_server
from stream_client import stream_generate

from srt_ascend.server_args import SHIPPED_MODEL

MTP = ["--speculative-algorithm", "MTP", "--speculative-num-steps", "2"]


def post(url: str, body: dict) -> float:
    """Seconds for one non-streaming /generate."""
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)
    return time.perf_counter() - started


def start_router(prefill: str, boot: int, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    cmd += ["--prefill", prefill, str(boot), "--decode", decode, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    for _ in range(300):
        try:
            post(url, body)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router did not serve")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 3072])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mtp", action="store_true", help="MTP K=2 on all servers")
    ap.add_argument("--json-out")
    ap.add_argument("--mix", action="store_true", help="TTFT/TPOT under a prefill-heavy mix")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30.0, help="s of arrivals per setup")
    ap.add_argument("--decode-every", type=float, default=1.0)
    ap.add_argument("--decode-prompt", type=int, default=48)
    ap.add_argument("--decode-output", type=int, default=128)
    ap.add_argument("--long-every", type=float, default=6.0)
    ap.add_argument("--long-prompt", type=int, nargs=2, default=[1024, 3072])
    ap.add_argument("--long-output", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--colocated-threads",
        type=int,
        help="also a colocated server with --num-threads N (a control: the same server on "
        "both cores without a 2-thread OpenMP team)",
    )
    a = ap.parse_args()
    if a.mix:
        mix(a)
        return
    extra = MTP if a.mtp else []
    boot = free_port()
    procs = []
    try:
        colocated_proc, colocated = start_server(SHIPPED_MODEL, extra)
        procs.append(colocated_proc)
        p_args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)]
        prefill_proc, prefill = start_server(SHIPPED_MODEL, [*extra, *p_args])
        procs.append(prefill_proc)
        decode_proc, decode = start_server(
            SHIPPED_MODEL, [*extra, "--disaggregation-mode", "decode"]
        )
        procs.append(decode_proc)
        router_proc, router = start_router(prefill, boot, decode)
        procs.append(router_proc)
        rng = random.Random(0)
        rows = []
        for n in a.lengths:
            runs = []
            for _ in range(a.repeats):
                sp = {"max_new_tokens": 1, "temperature": 0}
                ids = [rng.randrange(10, 8000) for _ in range(n)]
                colo = post(colocated, {"input_ids": ids, "sampling_params": sp})
                before = server_state(prefill)
                ids = [rng.randrange(10, 8000) for _ in range(n)]
                pd = post(router, {"input_ids": ids, "sampling_params": sp})
                after = server_state(prefill)
                runs.append(
                    {
                        "colocated_s": colo,
                        "pd_s": pd,
                        "kv_bytes": after["kv_transfer_bytes"] - before["kv_transfer_bytes"],
                        "transfer_s": after["kv_transfer_seconds"] - before["kv_transfer_seconds"],
                    }
                )
            row = {"prompt_tokens": n}
            row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            rows.append(row)
            print(
                f"{n:6d} tokens  KV {row['kv_bytes'] / 2**20:7.2f} MiB  transfer "
                f"{row['transfer_s'] * 1e3:7.1f} ms  colocated prefill "
                f"{row['colocated_s'] * 1e3:8.1f} ms  PD first token {row['pd_s'] * 1e3:8.1f} ms",
                flush=True,
            )
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump({"mtp": a.mtp, "repeats": a.repeats, "rows": rows}, f, indent=1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


# ---- the prefill-heavy mix ---------------------------------------------------------------------


def mix_requests(a, seed: int) -> list[dict]:
    """One round's requests in arrival order: {at (s after the start), kind, ids, n}."""
    rng = random.Random(seed)
    reqs = []
    t = rng.expovariate(1 / a.decode_every)
    while t < a.duration:
        ids = [rng.randrange(10, 8000) for _ in range(a.decode_prompt)]
        reqs.append({"at": t, "kind": "decode", "ids": ids, "n": a.decode_output})
        t += rng.expovariate(1 / a.decode_every)
    t = a.long_every / 2
    while t < a.duration:
        n = rng.randint(*a.long_prompt)
        ids = [rng.randrange(10, 8000) for _ in range(n)]
        at = t + rng.uniform(-0.25, 0.25) * a.long_every
        reqs.append({"at": at, "kind": "long", "ids": ids, "n": a.long_output})
        t += a.long_every
    return sorted(reqs, key=lambda r: r["at"])


def run_mix(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    """Sends `reqs` at their arrival times; per request its kind, prompt length, TTFT and TPOT
    (ms), tokens; and the output tok/s of the whole run."""
    out: list[dict] = [{} for _ in reqs]

    def one(i: int, r: dict) -> None:
        try:
            sent, times, got = stream_generate(url, r["ids"], r["n"])
        except Exception as e:  # recorded, and the run goes on: a failed request is a result
            out[i] = {"kind": r["kind"], "error": str(e)}
            return
        # per token after the first (bench_serving's TPOT; an MTP step's chunk has several)
        tpot = (times[-1] - times[0]) / (got - 1) * 1e3 if len(times) > 1 else None
        out[i] = {
            "kind": r["kind"],
            "prompt": len(r["ids"]),
            "tokens": got,
            "ttft_ms": (times[0] - sent) * 1e3,
            "tpot_ms": tpot,
            "sent": sent,
            "done": times[-1],
        }

    threads = []
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        time.sleep(max(0.0, start + r["at"] - time.perf_counter()))
        t = threading.Thread(target=one, args=(i, r))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    ok = [o for o in out if "error" not in o]
    span = max(o["done"] for o in ok) - min(o["sent"] for o in ok)
    return out, sum(o["tokens"] for o in ok) / span


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear between order statistics), None for no values."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list[dict], tok_s: list[float]) -> dict:
    """p50 / p99 of TTFT and TPOT per class (decode, long, all) and the mean output tok/s."""
    rows = {}
    for cls in ("decode", "long", "all"):
        rs = [r for r in results if "error" not in r and cls in ("all", r["kind"])]
        rows[cls] = {
            "n": len(rs),
            **{
                f"{m}_p{q}": round(pct([r[f"{m}_ms"] for r in rs], q), 2)
                for m in ("ttft", "tpot")
                for q in (50, 99)
                if pct([r[f"{m}_ms"] for r in rs], q) is not None
            },
        }
    rows["errors"] = sum("error" in r for r in results)
    rows["output_tok_s"] = round(statistics.mean(tok_s), 1)
    return rows


def print_mix_table(summary: dict) -> None:
    cols = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
    print(
        f"{'setup':<23}{'requests':<9}{'n':>4}  "
        + "".join(f"{c + ' ms':>14}" for c in cols)
        + f"{'out tok/s':>11}"
    )
    for cls in ("decode", "long", "all"):
        for setup in summary:
            row = summary[setup][cls]
            tok = summary[setup]["output_tok_s"]
            vals = "".join(
                f"{row[c]:>14.2f}" if row.get(c) is not None else f"{'-':>14}" for c in cols
            )
            n = row.get("n", "")
            print(
                f"{setup:<23}{cls:<9}{n!s:>4}  {vals}{tok:>11.2f}"
                if cls == "all"
                else f"{setup:<23}{cls:<9}{n!s:>4}  {vals}{'':>11}"
            )


def ratios(pd: dict, colo: dict) -> dict:
    out = {
        cls: {
            k: round(pd[cls][k] / colo[cls][k], 3) for k in pd[cls] if k != "n" and colo[cls].get(k)
        }
        for cls in ("decode", "long", "all")
    }
    out["output_tok_s"] = round(pd["output_tok_s"] / colo["output_tok_s"], 3)
    return out


def mix(a) -> None:
    extra = MTP if a.mtp else []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on kill too
    before = machine_info()
    print(f"machine before: {before}", flush=True)
    boot = free_port()
    procs = []
    try:
        colocated_proc, colocated = start_server(SHIPPED_MODEL, extra)
        procs.append(colocated_proc)
        pinned = [*extra, "--num-threads", "1"]
        p_args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)]
        prefill_proc, prefill = start_server(
            SHIPPED_MODEL, [*pinned, *p_args], prefix=["taskset", "-c", "0"]
        )
        procs.append(prefill_proc)
        decode_proc, decode = start_server(
            SHIPPED_MODEL,
            [*pinned, "--disaggregation-mode", "decode"],
            prefix=["taskset", "-c", "1"],
        )
        procs.append(decode_proc)
        router_proc, router = start_router(prefill, boot, decode)
        procs.append(router_proc)
        urls = {"colocated": colocated, "pd": router}
        if a.colocated_threads:
            control_proc, control = start_server(
                SHIPPED_MODEL, [*extra, "--num-threads", str(a.colocated_threads)]
            )
            procs.append(control_proc)
            urls[f"colocated_t{a.colocated_threads}"] = control
        results: dict[str, list] = {s: [] for s in urls}
        tok_s: dict[str, list] = {s: [] for s in urls}
        transfer_s: list[float] = []
        # a few requests of each kind, not measured (a seed no round uses: random.Random
        # seeds with abs(n), so -1 would repeat round 1's prompts and hit the radix cache)
        warm = mix_requests(a, a.seed * 1000 + 999)
        warm = [r for r in warm if r["kind"] == "long"][:1] + [
            r for r in warm if r["kind"] == "decode"
        ][:2]
        for url in urls.values():
            run_mix(url, [{**r, "at": 0.0} for r in warm])
        for rnd in range(a.rounds):
            reqs = mix_requests(a, a.seed * 1000 + rnd)
            order = list(urls) if rnd % 2 == 0 else list(reversed(urls))
            for setup in order:
                t_before = server_state(prefill)["kv_transfer_seconds"]
                got, rate = run_mix(urls[setup], reqs)
                for g in got:
                    g["round"] = rnd
                results[setup] += got
                tok_s[setup].append(rate)
                if setup == "pd":
                    transfer_s.append(server_state(prefill)["kv_transfer_seconds"] - t_before)
                errs = sum("error" in g for g in got)
                print(
                    f"round {rnd} {setup:9s}: {len(got)} requests ({errs} failed), "
                    f"{rate:.1f} output tok/s, load {machine_info()['load_avg']}",
                    flush=True,
                )
        summary = {s: summarize(results[s], tok_s[s]) for s in results}
        for s in list(results):
            if s != "colocated":
                summary[f"{s}/colocated"] = ratios(summary[s], summary["colocated"])
        long_n = sum(r["kind"] == "long" for r in results["pd"] if "error" not in r)
        summary["pd"]["transfer_ms_per_long_prompt"] = round(
            sum(transfer_s) / max(1, long_n) * 1e3, 2
        )
        after = machine_info()
        print_mix_table(summary)
        print(
            f"PD: KV transfer {summary['pd']['transfer_ms_per_long_prompt']} ms per long prompt "
            "(prefill server's kv_transfer_seconds; short prompts' share included)"
        )
        print(f"machine after: {after}")
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(
                    {
                        "config": {k: v for k, v in vars(a).items()},
                        "machine_before": before,
                        "machine_after": after,
                        "summary": summary,
                        "requests": {
                            s: [
                                {k: v for k, v in r.items() if k not in ("sent", "done")}
                                for r in results[s]
                            ]
                            for s in results
                        },
                    },
                    f,
                    indent=1,
                )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
