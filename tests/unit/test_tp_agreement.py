"""Tensor-parallel ranks commit alike even where their own sampling differs: a rank whose
logits differ from its group leader's in the last bit (so its argmax is another token) still
commits the leader's token, in a plain step (`Decoder.sample_and_commit`) and in an MTP
verdict (`MTPDecoder._read`). Gloo ranks (torch.multiprocessing): 2 ranks of one group, and
4 ranks in 2 data-parallel attention groups (each group agrees on its own first rank's read).
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from srt_ascend.decoding.base import DecoderHandles
from srt_ascend.decoding.plain import PlainDecoder
from srt_ascend.distributed import DistInit, init_tp_group
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.platforms.cpu import CpuPlatform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs
from srt_ascend.speculative.acceptance import AcceptResult
from srt_ascend.speculative.mtp_decoder import MTPDecoder

ONE_UP = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()  # 1.0 plus one ulp


def _logits(rank: int, dp_rank: int) -> torch.Tensor:
    """[1, 4]: two logits one ulp apart, in an order that depends on the rank: each group's
    first rank picks token 2 + dp_rank, the others token 3 - dp_rank."""
    hi, lo = (2 + dp_rank, 3 - dp_rank)
    if rank % 2:
        hi, lo = lo, hi
    row = torch.zeros(1, 4)
    row[0, hi], row[0, lo] = ONE_UP, 1.0
    return row


def _rank(local_rank: int, addr: str, world: int, dp: int) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(DistInit(addr, world), local_rank, "gloo", False, dp)
    try:
        runner = SimpleNamespace(vocab_size=4, tp=tp, attn_backend=None, platform=CpuPlatform())
        committed = []
        handles = DecoderHandles(runner, None, lambda r, t, lp: committed.append(t), [0])
        decoder = PlainDecoder(ServerArgs(model_path=SHIPPED_MODEL), handles)
        params = SamplingParams(temperature=0.0)
        params.normalize()
        req = Req("r", [1, 2], params)
        decoder.sample_and_commit([req], _logits(tp.rank, tp.dp_rank))
        assert committed == [[2 + tp.dp_rank]], (tp.rank, committed)
        # an MTP verdict: this rank accepted tp.rank drafts; the leader's verdict wins
        n = tp.rank
        res = AcceptResult(torch.tensor([n]), torch.tensor([[7] * (n + 1) + [-1] * (3 - n)]))
        copy = MTPDecoder._copy_verdict(decoder, res)
        verdict = MTPDecoder._read(decoder, res, torch.zeros(1, 4, 4), copy)
        leader = tp.dp_rank * (world // dp)
        assert verdict.accept_len == [leader], (tp.rank, verdict)
        assert verdict.emitted == [[7] * (leader + 1) + [-1] * (3 - leader)]
    finally:
        tp.destroy()


@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)])
def test_ranks_commit_their_leaders_read(world, dp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.start_processes(
        _rank, args=(addr, world, dp), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):  # raises as soon as a rank fails (the others are ended)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("the ranks did not finish within 180 s")
