"""The draft-length policies on a simulated device: the real planners (speculative/draft_length)
over a step-cost table of an accelerator's shape and requests of known acceptance, with the
outcomes drawn. A figure of the policy alone, not of a server: it names what the planner
would pick where drafting pays, which a 2-core CPU (where MTP off wins every workload) cannot
show.

    python benchmark/policy_sim.py [--steps 3000] [--seeds 3] [--output-len 64]
        [--draft-step 0.3] [--row 0.01] [--json-out FILE]

Costs (ms), per step of K drafts over a batch in bucket b verifying `rows` rows:
P(b, K) = 1 + DRAFT_STEP x K + ROW x b x (1 + K), its row-proportional part W(n) = ROW x n
(the ragged verify's saving): at 1 request K = 3 costs 1.9x a plain step, at 64 requests
2.7x. Each request accepts each draft with its own probability (code: 0.85, chat: 0.35,
random: 0.05), drafts stop at the first rejection; a finished request (`output-len` tokens) is
replaced by a new one of the same kind, so the batch stays full. Configurations: MTP off,
fixed K = 1, 2, 3, batch-adaptive (one K per step), per-request adaptive (ragged plans).
Printed: tokens per ms of each, and adaptive over the best fixed K (MTP off included); the
mixed workload (half code, half random at 16) against every server-wide K, with the kinds the
server tells apart (code greedy, random sampled: each new request's prior is its kind's
recent acceptance) and with one kind for all.
"""

from __future__ import annotations

import argparse
import json
import random

from srt_ascend.speculative.draft_length import (
    AdaptiveDraftLength,
    FixedDraftLength,
)
from srt_ascend.speculative.step_costs import CostTable

BUCKETS = [1, 2, 4, 8, 16, 32, 64]
MAX_K = 3
DRAFT_STEP = 0.3  # ms per draft step (and its share of the MTP pass): --draft-step
ROW = 0.01  # ms per verified row: --row
# acceptance per draft, and the kind the server tells apart (code greedy, the rest sampled)
KINDS = {"code": (0.85, "greedy"), "chat": (0.35, "sampled"), "random": (0.05, "sampled")}
WORKLOADS = {  # name: (batch, kinds in turn, whether the server sees their kinds)
    **{f"code@{n}": (n, ["code"], True) for n in (1, 4, 16, 64)},
    **{f"random@{n}": (n, ["random"], True) for n in (1, 4, 16, 64)},
    "chat@16": (16, ["chat"], True),
    "mixed@16": (16, ["code", "random"], True),
    "mixed-unlabelled@16": (16, ["code", "random"], False),  # one kind to the server
}
CONFIGS = ("off", "k1", "k2", "k3", "batch-adaptive", "per-request")


def cost_table(draft_step: float, row: float) -> CostTable:
    profile = {
        (b, k): 1.0 + draft_step * k + row * b * (1 + k) for b in BUCKETS for k in range(MAX_K + 1)
    }
    rows = {n: row * n for n in (1, max(BUCKETS) * (MAX_K + 1))}
    return CostTable(BUCKETS, MAX_K, profile, rows)


def policy_for(config: str, table: CostTable):
    if config in ("batch-adaptive", "per-request"):
        policy = AdaptiveDraftLength(MAX_K, BUCKETS)
        policy.ragged = config == "per-request"
    else:
        policy = FixedDraftLength({"off": 0, "k1": 1, "k2": 2, "k3": 3}[config], BUCKETS)
    policy.costs = table
    return policy


def simulate(config: str, batch: int, kinds: list[str], labelled: bool, args, seed: int):
    """Tokens per ms over `args.steps` steps of a full batch (the first tenth not counted)."""
    rng = random.Random(seed)
    steps, out_len = args.steps, args.output_len
    policy = policy_for(config, cost_table(args.draft_step, args.row))
    table = policy.costs

    def new(i: int) -> list:
        """A request: [kind, acceptance estimate, tokens left]."""
        kind = kinds[i % len(kinds)]
        return [kind, policy.initial_estimate(KINDS[kind][1] if labelled else ""), out_len]

    reqs = [new(i) for i in range(batch)]
    made, tokens, ms = batch, 0, 0.0
    for step in range(steps):
        estimates = [r[1] for r in reqs]
        plan = policy.plan(estimates, True, config == "per-request")
        k = max(plan)
        rows = sum(n + 1 for n in plan) if config == "per-request" else None  # ragged verify
        seconds = table.profiled(table.bucket(batch), k, rows, batch)
        accepted = []
        for r, n in zip(reqs, plan):
            a = 0
            while a < n and rng.random() < KINDS[r[0]][0]:
                a += 1
            accepted.append(a)
        policy.record(estimates, k, accepted, seconds, plan)
        emitted = 0
        for i, (r, a) in enumerate(zip(reqs, accepted)):
            got = min(a + 1, r[2])
            r[2] -= got
            emitted += got
            if not r[2]:
                reqs[i] = new(made)
                made += 1
        if step >= steps // 10:
            tokens += emitted
            ms += seconds
    return tokens / ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--draft-step", type=float, default=DRAFT_STEP)
    ap.add_argument("--row", type=float, default=ROW)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    res: dict[str, dict[str, float]] = {}
    for wl, (batch, kinds, labelled) in WORKLOADS.items():
        for config in CONFIGS:
            runs = [
                simulate(config, batch, kinds, labelled, args, seed) for seed in range(args.seeds)
            ]
            res.setdefault(wl, {})[config] = sum(runs) / len(runs)
    print(f"{'workload':20s} " + " ".join(f"{c:>14s}" for c in CONFIGS) + "  adaptive/best fixed")
    for wl, row in res.items():
        best = max(("off", "k1", "k2", "k3"), key=row.__getitem__)
        mine = ("batch-adaptive", "per-request")
        ratios = " ".join(f"{c} {row[c] / row[best]:.2f}x" for c in mine)
        cells = " ".join(f"{row[c]:14.2f}" for c in CONFIGS)
        print(f"{wl:20s} {cells}  (best {best}) {ratios}")
    for wl in ("mixed@16", "mixed-unlabelled@16"):
        row = res[wl]
        over = ", ".join(f"{c} {row['per-request'] / row[c]:.2f}x" for c in CONFIGS[:-1])
        print(f"{wl} per-request over: {over}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "tokens_per_ms": res}, f, indent=1)


if __name__ == "__main__":
    main()
