"""Engines started one after another in one process (notebooks, test suites): the time from
`Engine(...)` to its return (ready: the grammar compiler's child has said "started"), with the
idle child of the Engine before handed on, against a fresh child (the hand-on undone before
each start: the child imports xgrammar, as every start did before), interleaved.

    python benchmark/engine_start.py [--model-path DIR] [--dtype float32] [--rounds 4]
        [--json-out FILE]

Each start is followed by a two-token greedy request and a shutdown. Prints the median start
of each mode and their ratio; the first start of the process (imports, page cache) is not
counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from machine import machine_info

from srt_ascend import Engine
from srt_ascend.constrained import compile_worker
from srt_ascend.server_args import SHIPPED_MODEL


def start_once(model_path: str, dtype: str, fresh: bool) -> float:
    if fresh:  # no idle child waits: this start spawns one (the behaviour before hand-on)
        spare = compile_worker._take_spare()
        if spare is not None:
            compile_worker._end(spare)
    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, dtype=dtype)
    seconds = time.perf_counter() - t0
    try:
        engine.generate("def f(", {"max_new_tokens": 2, "temperature": 0})
    finally:
        engine.shutdown()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=SHIPPED_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    before = machine_info()
    start_once(a.model_path, a.dtype, fresh=True)  # imports, page cache: not counted
    runs: dict[str, list[float]] = {"fresh child": [], "handed on": []}
    for _ in range(a.rounds):
        for mode in runs:
            runs[mode].append(start_once(a.model_path, a.dtype, fresh=mode == "fresh child"))
    med = {mode: statistics.median(s) for mode, s in runs.items()}
    for mode, s in runs.items():
        print(f"{mode:>12}: median {med[mode]:.2f} s  ({', '.join(f'{x:.2f}' for x in s)})")
    print(f"handed on / fresh child: {med['handed on'] / med['fresh child']:.2f}x")
    if a.json_out:
        res = {"runs_s": runs, "median_s": med, "machine": before}
        res["machine"]["load_avg_after"] = machine_info()["load_avg"]
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
