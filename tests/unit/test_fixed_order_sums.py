"""Tensor-parallel all-reduces under `--enable-deterministic-inference`
(`distributed.set_fixed_order_sums`): a row's sum over the ranks is the same bits whether the
all-reduced tensor holds that row alone or hundreds of rows around it, on every rank. 4 gloo
ranks (torch.multiprocessing), bf16 partial sums as the row-parallel o_proj / down_proj and the
MoE give them. Control: gloo's own all-reduce over 4 ranks adds an element's parts in an order
that follows its place in the buffer, so the same rows differ (2 ranks: one commutative
addition per element, nothing to fix).
"""

from __future__ import annotations

import socket
import time

import torch
import torch.multiprocessing as mp

from srt_ascend.distributed import DistInit, init_tp_group, set_fixed_order_sums

WORLD = 4
ROWS = [0, 1, 37, 150, 299]


def _sums(tp) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the all-reduced [300, 96] partials, each of ROWS all-reduced alone and in a 7-row
    window)."""
    gen = torch.Generator().manual_seed(tp.rank)
    x = (torch.randn(300, 96, generator=gen) * (1 + tp.rank)).to(torch.bfloat16)
    whole = tp.all_reduce(x.clone())
    parts = []
    for r in ROWS:
        parts.append(tp.all_reduce(x[r : r + 1].clone())[0])
        lo = max(0, r - 3)
        parts.append(tp.all_reduce(x[lo : lo + 7].clone())[r - lo])
    return whole, parts


def _differing(tp) -> tuple[int, bool]:
    """(how many of ROWS' sums differ from the same rows in the whole, whether every rank
    holds the whole's bits)."""
    whole, parts = _sums(tp)
    rows = [r for r in ROWS for _ in range(2)]
    differing = sum(not torch.equal(p, whole[r]) for p, r in zip(parts, rows))
    return differing, all(torch.equal(w, whole) for w in tp.all_gather_object(whole))


def _rank(local_rank: int, addr: str, out) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(DistInit(addr, WORLD), local_rank, "gloo")
    try:
        set_fixed_order_sums(True)
        fixed = _differing(tp)
        set_fixed_order_sums(False)
        out.put((local_rank, fixed, _differing(tp)))
    finally:
        tp.destroy()


def test_fixed_order_all_reduce_is_row_invariant_and_control():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(
        _rank, args=(addr, queue), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("the ranks did not finish within 180 s")
    results = sorted(queue.get() for _ in range(WORLD))
    assert [fixed for _, fixed, _ in results] == [(0, True)] * WORLD, results
    assert sum(control[0] for _, _, control in results) > 0, (
        "gloo's own all-reduce was row-invariant here: the test has no power"
    )
