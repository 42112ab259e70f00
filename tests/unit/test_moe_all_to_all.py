"""The all-to-all dispatch and combine (`--moe-a2a-backend all_to_all`) against one process:
4 gloo ranks (torch.multiprocessing) form 2 DP groups of 2 ranks, the 8 routed experts are
partitioned over all 4 (2 each), and every rank's `forward_all_to_all` over its group's tokens
must equal the whole layer's output in one process (routed experts weighted and summed, plus
the shared expert). The rounds split a group's tokens unevenly between its two ranks, leave one
rank without a share, and leave one DP group idle while the other has tokens."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from srt_ascend.distributed import DistInit, TPGroup, init_tp_group
from srt_ascend.layers.moe import DeepseekMoE

CONFIG = SimpleNamespace(
    hidden_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    moe_intermediate_size=24,
    n_shared_experts=1,
)
WORLD, DP = 4, 2
ROUNDS = [(5, 0), (3, 7), (1, 2)]  # tokens of DP group 0, DP group 1


def whole_layer() -> DeepseekMoE:
    """The layer in one process, every weight random (the router bias included)."""
    torch.manual_seed(0)
    moe = DeepseekMoE(CONFIG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe.eval()


def rank_layer(whole: DeepseekMoE, tp: TPGroup) -> DeepseekMoE:
    """`tp.rank`'s share of `whole`: its experts, the router and the shared expert."""
    moe = DeepseekMoE(CONFIG, tp)
    n = moe.experts.n_experts
    state = whole.state_dict()
    for name in ("experts.w13", "experts.w2"):
        state[name] = state[name][tp.rank * n : (tp.rank + 1) * n]
    moe.load_state_dict(state)
    return moe.eval()


def group_tokens(dp_rank: int, round_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * round_index + dp_rank)
    return torch.randn(ROUNDS[round_index][dp_rank], CONFIG.hidden_size, generator=g)


def _rank(local_rank: int, addr: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(DistInit(addr, WORLD), local_rank, "gloo", True, DP, moe_all_to_all=True)
    try:
        whole = whole_layer()
        layer = rank_layer(whole, tp)
        assert layer.all_to_all is not None and tp.attn_group.size == WORLD // DP
        for i in range(len(ROUNDS)):
            x = group_tokens(tp.dp_rank, i)
            with torch.inference_mode():
                got, expected = layer.forward_all_to_all(x), whole(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # per call: the counts, the rows out, the outputs back; the shares gathered once
        assert tp.counts["all_to_all"][0] == 3 * len(ROUNDS)
        assert tp.counts["all_gather"][0] == len(ROUNDS)
    finally:
        tp.destroy()


def test_all_to_all_dispatch_equals_one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.start_processes(_rank, args=(addr,), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):  # raises as soon as a rank fails (the others are ended)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("the ranks did not finish within 180 s")
