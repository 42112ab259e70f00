"""A batch whose sequence lengths are on the device and whose host lengths are only upper
bounds (an overlapped MTP round: its lengths follow the previous round's accept lengths, which
the host has not read) attends exactly as the same batch with exact host lengths: positions,
and every backend that takes bounds (`AttentionBackend.takes_length_bounds`)."""

from __future__ import annotations

import pytest
import torch

import srt_ascend.layers.attention.fia_backend  # noqa: F401  (registers "fia")
from srt_ascend.layers.attention.base import create_attention_backend
from srt_ascend.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode

RANK, ROPE, HEADS = 16, 8, 2


def batches(backend: str, page_size: int, q: int, seq: list[int], slack: list[int]):
    """The same rows built twice: exact host lengths, and device lengths with host bounds
    seq + slack. Slots past each row's length hold KV too (what a previous round wrote),
    so reading past a row's length would change its output."""
    gen = torch.Generator().manual_seed(3)
    rows, longest = len(seq), max(s + d for s, d in zip(seq, slack))
    width = -(-longest // page_size) * page_size + page_size  # whole pages
    slots = rows * width + page_size
    pool = MLATokenToKVPool(slots, page_size, torch.float32, RANK, ROPE, 1)
    everything = torch.arange(page_size, slots + page_size)
    pool.set_mla_kv_buffer(
        0,
        everything,
        torch.randn(len(everything), 1, RANK, generator=gen),
        torch.randn(len(everything), 1, ROPE, generator=gen),
    )
    table = ReqToTokenPool(rows, width)
    for r in range(rows):  # row r holds pages of its own, in order
        table.req_to_token[r] = page_size + r * width + torch.arange(width)
    loc = torch.cat([table.req_to_token[r, s - q : s] for r, s in enumerate(seq)])
    ids = torch.zeros(rows * q, dtype=torch.int64)
    be = create_attention_backend(backend)
    common = (ForwardMode.TARGET_VERIFY, ids, list(range(rows)))
    exact = ForwardBatch.build(*common, seq, [q] * rows, loc, table, pool, be)
    bounds = [s + d for s, d in zip(seq, slack)]
    bounded = ForwardBatch.build(
        *common, torch.tensor(seq), [q] * rows, loc, table, pool, be, seq_bounds=bounds
    )
    return be, exact, bounded, gen


@pytest.mark.parametrize("backend", ["torch_native", "fia"])
@pytest.mark.parametrize("page_size,q", [(1, 1), (1, 3), (4, 3)])
def test_device_lengths_with_host_bounds_attend_as_exact_lengths(backend, page_size, q):
    seq, slack = [7, 12, 4], [5, 0, 9]
    be, exact, bounded, gen = batches(backend, page_size, q, seq, slack)
    assert not bounded.host_lengths_exact and bounded.seq_lens_cpu == [12, 12, 13]
    assert torch.equal(bounded.positions, exact.positions)
    assert be.takes_length_bounds(torch.device("cpu"))
    t = len(seq) * q
    q_latent = torch.randn(t, HEADS, RANK, generator=gen)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen)
    c_kv = torch.randn(t, 1, RANK, generator=gen)
    k_pe = torch.randn(t, 1, ROPE, generator=gen)
    outs = []
    for fb in (exact, bounded):
        be.init_forward_metadata(fb)
        outs.append(be.forward(q_latent, q_pe, c_kv, k_pe, 0, 0.125, fb))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_device_lengths_need_bounds_and_one_query_length():
    table = ReqToTokenPool(2, 16)
    pool = MLATokenToKVPool(32, 1, torch.float32, RANK, ROPE, 1)
    be = create_attention_backend("torch_native")
    args = (ForwardMode.DECODE, [0, 0], [0, 1], torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="host bounds"):
        ForwardBatch.build(*args, [1, 1], torch.tensor([3, 4]), table, pool, be)
    with pytest.raises(ValueError, match="one query length"):
        ForwardBatch.build(
            *args, [1, 2], torch.tensor([3, 4, 5]), table, pool, be, seq_bounds=[5, 5]
        )
