"""Graph capture/replay check and timing, for a lent GPU (or NPU); runs on CPU as a dry run.

    python benchmark/graph_check.py [--device cuda] [--dtype bfloat16] [--k 2]
        [--buckets 1 2 4 8 12 16 24 32] [--iters 50] [--json-out FILE]

On the shipped checkpoint, captures decode, target verify (batch expansion: CUDA graphs cannot
refresh FIA's host-side lengths; on NPU and CPU the FIA kind is checked too) and the MTP
draft forwards for every bucket, then per bucket and kind: replays a batch of that many
requests (prompts of different lengths, prefilled eagerly), checks the replayed hidden states
against the eager forward, and times both (device events where the device has them, else
wall clock around synchronised loops). The target of issue 6: decode replay at least 3x faster
than eager per step at batch 1 on a GPU. Under 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs


def timed(platform, fn, iters: int) -> float:
    """Median milliseconds per call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        platform.synchronize()
        t0 = time.perf_counter()
        fn()
        platform.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class Batch:
    """`n` requests with prompts of lengths 20, 27, 34, ... prefilled eagerly."""

    def __init__(self, runner: ModelRunner, n: int, k: int) -> None:
        self.runner, self.k = runner, k
        self.lens = [20 + 7 * (i % 9) for i in range(n)]
        cap = max(self.lens) + k + 2
        cap += -cap % runner.allocator.page_size
        self.rows = runner.req_to_token_pool.alloc(n)
        self.slots = [runner.allocator.alloc(cap) for _ in range(n)]
        for row, s in zip(self.rows, self.slots):
            runner.req_to_token_pool.req_to_token[row, :cap] = s
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(3, runner.vocab_size, (sum(self.lens),), generator=g)
        loc = torch.cat([s[:n_] for s, n_ in zip(self.slots, self.lens)])
        lens = self.lens
        fb = runner.build_forward_batch(ForwardMode.EXTEND, ids, self.rows, lens, lens, loc)
        h = runner.forward(fb)
        if runner.mtp is not None:
            fb = runner.build_forward_batch(
                ForwardMode.DRAFT_EXTEND, ids, self.rows, lens, lens, loc
            )
            runner.forward_mtp(fb, h, 0)

    def fb(self, kind: str):
        r, k1 = self.runner, self.k + 1
        q = 1 if kind in ("decode", "draft_step") else k1
        seq = [n + q for n in self.lens]
        loc = torch.cat([s[n : n + q] for s, n in zip(self.slots, self.lens)]).to(r.device)
        ids = torch.full((len(self.lens) * q,), 5, dtype=torch.int64)
        if kind == "verify_expand":
            rows = [row for row in self.rows for _ in range(k1)]
            seqs = [n + j + 1 for n in self.lens for j in range(k1)]
            return r.build_forward_batch(
                ForwardMode.TARGET_VERIFY, ids, rows, seqs, [1] * len(rows), loc, r.verify_backend
            )
        mode = next(k.mode for n, k in r.graph_runner.kinds.items() if n.startswith(kind))
        backend = r.verify_backend if mode == ForwardMode.TARGET_VERIFY else r.attn_backend
        return r.build_forward_batch(mode, ids, self.rows, seq, [q] * len(seq), loc, backend)

    def free(self) -> None:
        for s in self.slots:
            self.runner.allocator.free(s)
        self.runner.req_to_token_pool.free(self.rows)


def check(runner: ModelRunner, platform, fb, layer: int | None, iters: int) -> dict:
    """Replay vs eager on one batch: the largest difference and the median times."""
    gr = runner.graph_runner
    hidden = None
    if layer is not None:
        hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, device=runner.device)
        hidden = hidden.to(runner.dtype)
    assert gr.can_run(fb, layer)
    ref = runner.forward_eager(fb, layer, hidden).float()
    diff = (gr.replay(fb, layer, hidden).float() - ref).abs().max().item()
    scale = 1e-3 if runner.dtype == torch.float32 else 0.1 * max(1.0, ref.abs().max().item())
    t_eager = timed(platform, lambda: runner.forward_eager(fb, layer, hidden), iters)
    t_replay = timed(platform, lambda: gr.replay(fb, layer, hidden), iters)
    return {
        "eager_ms": t_eager,
        "replay_ms": t_replay,
        "speedup": t_eager / t_replay,
        "max_diff": diff,
        "ok": diff <= scale,
    }


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=SHIPPED_MODEL)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=2, help="MTP draft tokens per step")
    ap.add_argument(
        "--verify",
        default=None,
        help="expand or fia (default: fia where graphs can refresh its host lengths, else expand)",
    )
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    platform = get_platform(a.device)
    verify = a.verify or ("fia" if platform.new_graph().supports_host_params else "expand")
    args = ServerArgs(
        model_path=a.model_path,
        device=platform.name,
        dtype=a.dtype,
        context_length=1024,
        max_running_requests=max(a.buckets),
        max_total_tokens=max(a.buckets) * 1200,
        speculative_algorithm="MTP",
        speculative_num_steps=a.k,
        speculative_verify=verify,
        enable_cpu_graph=True,
        cuda_graph_bs=tuple(a.buckets),
        cuda_graph_max_bs=max(a.buckets),
    ).for_device(platform.name)
    t0 = time.perf_counter()
    runner = ModelRunner(args, platform)
    gr = runner.graph_runner
    capture_s = time.perf_counter() - t0
    device_name = torch.cuda.get_device_name() if platform.name == "cuda" else platform.name
    print(
        f"device {device_name}, {a.dtype}, K={a.k}, verify {verify}; "
        f"load + capture of {len(gr.graphs)} graphs: {capture_s:.1f} s"
    )
    kinds = [
        ("decode", None),
        ("verify_fia" if verify == "fia" else "verify_expand", None),
        ("draft_extend", 0),
    ]
    if a.k > 1:
        kinds.append(("draft_step", runner.mtp.layer_for_step(1)))
    rows, failures = [], 0
    print(f"{'bs':>3} {'kind':<14} {'eager ms':>9} {'replay ms':>9} {'speedup':>8} {'max diff':>9}")
    for bs in a.buckets:
        batch = Batch(runner, bs, a.k)
        for kind, layer in kinds:
            row = check(runner, platform, batch.fb(kind), layer, a.iters)
            rows.append({"bs": bs, "kind": kind, **row})
            failures += not row["ok"]
            print(
                f"{bs:>3} {kind:<14} {row['eager_ms']:>9.3f} {row['replay_ms']:>9.3f} "
                f"{row['speedup']:>7.2f}x {row['max_diff']:>9.2e}"
                + ("" if row["ok"] else "  MISMATCH")
            )
        batch.free()
    bs1 = next(r for r in rows if r["bs"] == min(a.buckets) and r["kind"] == "decode")
    print(
        f"decode at batch {bs1['bs']}: replay {bs1['speedup']:.2f}x faster than eager "
        f"(target on a GPU: >= 3x); {failures} mismatches"
    )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(
                {
                    "device": device_name,
                    "dtype": a.dtype,
                    "k": a.k,
                    "verify": verify,
                    "capture_s": capture_s,
                    "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
