"""Server start with --enable-torch-compile: launch -> /health 200 -> every shape compiled.

    python benchmark/compile_start.py [--runs cold warm] [--cache-dir DIR] [--json-out FILE]
        [--server-args "..."]

One server per run (shipped checkpoint, bf16, MTP K = 2 through FIA, --torch-compile-max-bs 1
--context-length 256 unless --server-args says otherwise), all runs against one
TORCHINDUCTOR_CACHE_DIR: "cold" empties it first, "warm" keeps what the runs before it wrote
(inductor's FX graph cache and autotune results, and the AOTInductor packages a warm start
loads its compiled shapes from: model_executor/compile_packages.py). Per run: seconds from
launch to the first /health 200 (the server serves from there, uncompiled where a shape is
not compiled yet), to /server_info's `torch_compile` reporting every shape compiled, the
shapes compiled and how many of them were loaded from the cache, and the load average
(`os.getloadavg`, 1 min) at the end of the run. `--log-dir DIR` keeps each server's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from serving import free_port, server_state

from srt_ascend.server_args import SHIPPED_MODEL

SMALL = (
    "--speculative-algorithm MTP --speculative-num-steps 2 --speculative-verify fia "
    "--enable-torch-compile --torch-compile-max-bs 1 --context-length 256"
)


def start_times(model: str, extra: list[str], cache_dir: str, log: str | None = None) -> dict:
    """Launches one server; returns when every shape is compiled (then stops it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-m", "srt_ascend.launch_server", "--model-path", model]
    err = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "warning", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        health_s = time.perf_counter() - t0
        while not (progress := server_state(url)["torch_compile"]).get("ready", True):
            time.sleep(0.5)
        return dict(
            health_s=round(health_s, 1),
            all_compiled_s=round(time.perf_counter() - t0, 1),
            shapes=progress.get("total", 0),
            compiled=progress.get("compiled", 0),
            loaded=progress.get("loaded", 0),
            load_avg_1m=round(os.getloadavg()[0], 2),
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if log:
            err.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    p.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--server-args", default=SMALL)
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None, help="keep each server's stderr here")
    a = p.parse_args()
    cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="inductor_")
    rows = []
    for run in a.runs:
        if run == "cold":
            shutil.rmtree(cache_dir, ignore_errors=True)
        log = os.path.join(a.log_dir, f"{len(rows)}_{run}.log") if a.log_dir else None
        row = {"run": run, **start_times(a.model_path, a.server_args.split(), cache_dir, log)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| run | /health 200 (s) | all shapes compiled (s) | compiled | loaded | load 1m |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['run']} | {r['health_s']} | {r['all_compiled_s']} | {r['compiled']} "
            f"| {r['loaded']} | {r['load_avg_1m']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"server_args": a.server_args, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
