"""Prefill-decode disaggregation: what moving a prompt's KV costs next to computing it.

    python benchmark/disaggregation.py [--lengths 128 512 1024 2048 3072] [--repeats 3]
        [--mtp] [--json-out FILE]

One colocated server, and a prefill server + a decode server behind sglang-router
`--pd-disaggregation` (Mooncake's transfer engine over TCP on localhost), all on the
shipped checkpoint (bf16 by default). Per prompt length: a fresh random prompt (no radix
hit) with max_new_tokens 1 to the colocated server (its wall time: the prefill, with HTTP),
another through the router (its wall time: prefill + registration + transfer + the decode
server's first output), and the prefill server's KV bytes and transfer seconds for it (from
/server_info's kv_transfer_* totals). Medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from serving import free_port, server_state, start_server

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
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
