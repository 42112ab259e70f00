"""The batch-invariant Triton kernels of `--enable-deterministic-inference` on CUDA, under the
Triton interpreter: the fixed-tile GEMM (`ops/matmul_triton.py`) and the MLA attention kernel
with fixed KV parts (`mla_attention(..., kv_split_size=...)`), each against its torch
reference and for batch invariance - a row's (a query's) result computed inside products
(batches) of other sizes and compositions is the same bit for bit, in float32 and bf16 (the
interpreter computes bf16 dots in float32; on a GPU `benchmark/device_check.py` repeats the
invariance checks with tensor-core dots).

Controls: the attention kernel's default split plan (parts sized by the batch's longest KV)
gives a query other bits alone than inside a longer batch, so the invariance asserted here is
not what the kernel gives anyway.
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.ops.mla_attention import mla_attention_reference
from tests.unit.triton_interpreter import import_interpreted

attn_triton, _, _, mm_triton = import_interpreted()
H, R, P = 4, 32, 8
SPLIT = 64  # keys per KV part in these tests (several parts at ~150 keys)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


# --- GEMM ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_torch_and_is_row_invariant(dtype):
    """x @ w.T + b over 150 rows (K = 100: a partial last K step) equals F.linear within
    one rounding; every prefix of the rows, and each row alone, gives the same bits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(150, 100, generator=gen).to(dtype)
    w = torch.randn(90, 100, generator=gen).to(dtype)
    b = torch.randn(90, generator=gen).to(dtype)
    full = mm_triton.linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert full.dtype == dtype and full.shape == (150, 90)
    torch.testing.assert_close(full.float(), ref, **TOL[dtype])
    for m in (1, 2, 5, 16, 63, 64, 65, 129):
        assert torch.equal(mm_triton.linear(x[:m], w, b), full[:m]), m
    for r in (0, 37, 64, 149):  # row r alone: row 0 of a 1-row product, row r of the full one
        assert torch.equal(mm_triton.linear(x[r : r + 1], w, b)[0], full[r]), r
    # leading dimensions are kept; no bias
    x3 = x[:12].view(3, 4, 100)
    assert torch.equal(mm_triton.linear(x3, w), mm_triton.linear(x[:12], w).view(3, 4, 90))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_matches_torch_and_is_row_invariant(dtype):
    """a [E, M, K] @ b (a transposed stack, as the MoE's and MLA's weights are passed)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 70, 48, generator=gen).to(dtype)
    w = torch.randn(3, 40, 48, generator=gen).to(dtype)
    full = mm_triton.bmm(a, w.transpose(1, 2))
    torch.testing.assert_close(
        full.float(), torch.bmm(a.float(), w.float().transpose(1, 2)), **TOL[dtype]
    )
    for m in (1, 3, 17, 69):
        assert torch.equal(mm_triton.bmm(a[:, :m], w.transpose(1, 2)), full[:, :m]), m
    assert torch.equal(mm_triton.bmm(a[:, 50:51], w.transpose(1, 2))[:, 0], full[:, 50])


# --- attention -----------------------------------------------------------------------------


class Cache:
    """A paged latent cache (page size 16, pages in shuffled order) with request rows: row 1
    the subject (`subject_len` tokens), rows 2.. others."""

    def __init__(self, gen, dtype, lengths):
        page = 16
        pages = 1 + sum(-(-n // page) for n in lengths)
        self.c_kv = torch.randn(pages * page, 1, R, generator=gen).to(dtype)
        self.k_pe = torch.randn(pages * page, 1, P, generator=gen).to(dtype)
        order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
        self.r2t = torch.zeros(len(lengths) + 1, max(lengths) + 1, dtype=torch.int64)
        for row, n in enumerate(lengths, start=1):
            pg = torch.tensor([order.pop() for _ in range(-(-n // page))])
            slots = (pg[:, None] * page + torch.arange(page)).flatten()
            self.r2t[row, :n] = slots[:n]
        self.dtype = dtype

    def run(self, rows, splits=None, split_size=SPLIT):
        """rows: (request row, seq_len, queries [q, H, R + P]) per batch row -> the output per
        batch row. splits: the number of KV parts (default: what covers the longest KV)."""
        q = torch.cat([x for _, _, x in rows])
        q_lens = torch.tensor([x.shape[0] for _, _, x in rows])
        args = (
            q[..., :R].contiguous(), q[..., R:].contiguous(), self.c_kv, self.k_pe, self.r2t,
            torch.tensor([r for r, _, _ in rows]), torch.tensor([n for _, n, _ in rows]),
            q_lens, torch.cumsum(q_lens, 0) - q_lens, 0.3,
        )  # fmt: skip
        max_kv = max(n for _, n, _ in rows)
        if split_size is not None and splits is None:
            splits = attn_triton.invariant_kv_splits(max_kv, split_size)
        out = attn_triton.mla_attention(
            *args, max_q_len=int(q_lens.max()), num_kv_splits=splits or 1,
            kv_split_size=split_size,
        )  # fmt: skip
        ref = mla_attention_reference(*args)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[self.dtype])
        return list(out.split(q_lens.tolist()))


def subject_compositions(cache, gen, queries, length, others):
    """The subject's last len(queries) queries (positions length - n .. length - 1) computed
    as: a verify row among other rows; the expanded verify layout (one-query rows over one
    request row); each alone as a decode; the tail of a 40-token prefill chunk; a batch whose
    longest KV needs more parts than the subject's. Returns the outputs of those queries."""
    n = queries.shape[0]
    verify = cache.run([others[0], (1, length, queries), others[1]])[1]
    expand = torch.cat(cache.run([(1, length - n + 1 + i, queries[i : i + 1]) for i in range(n)]))
    decodes = [cache.run([(1, length - n + 1 + i, queries[i : i + 1])])[0] for i in range(n)]
    earlier = torch.randn(40 - n, *queries.shape[1:], generator=gen).to(queries.dtype)
    chunk_q = torch.cat([earlier, queries])
    chunk = cache.run([(1, length, chunk_q), others[2]])[0][-n:]
    padded = cache.run([(1, length, queries)], splits=9)[0]  # more parts than any row needs
    return {
        "verify": verify,
        "expand": expand,
        "decode": torch.cat(decodes),
        "chunk": chunk,
        "padded": padded,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [3, 150])
def test_attention_fixed_parts_are_batch_invariant(dtype, length):
    """With kv_split_size a query's output does not change with the batch, its row's layout
    (verify multi-query, expanded, decode, prefill chunk) or the number of parts."""
    gen = torch.Generator().manual_seed(length)
    lengths = [length, 200, 90, 130]
    cache = Cache(gen, dtype, lengths)
    n = min(3, length)
    queries = torch.randn(n, H, R + P, generator=gen).to(dtype)
    others = [
        (2, 200, torch.randn(2, H, R + P, generator=gen).to(dtype)),
        (3, 90, torch.randn(5, H, R + P, generator=gen).to(dtype)),
        (4, 130, torch.randn(1, H, R + P, generator=gen).to(dtype)),
    ]
    outs = subject_compositions(cache, gen, queries, length, others)
    for name, out in outs.items():
        assert torch.equal(out, outs["verify"]), name


def test_attention_default_split_plan_is_not_batch_invariant():
    """The control: without fixed parts the same query alone (one part) and inside a batch
    whose longest KV gets three parts is reduced in another order."""
    gen = torch.Generator().manual_seed(7)
    cache = Cache(gen, torch.float32, [150, 200])
    q = torch.randn(1, H, R + P, generator=gen)
    other = (2, 200, torch.randn(1, H, R + P, generator=gen))
    alone = cache.run([(1, 150, q)], splits=1, split_size=None)[0]
    batched = cache.run([(1, 150, q), other], splits=3, split_size=None)[0]
    assert not torch.equal(alone, batched)


def test_fixed_tile_and_split_arguments():
    assert attn_triton.tile_shape(4, 1, fixed=True) == attn_triton.tile_shape(4, 9, fixed=True)
    assert attn_triton.tile_shape(4, 1) != attn_triton.tile_shape(4, 1, fixed=True)
    assert attn_triton.invariant_kv_splits(0) == 1
    assert attn_triton.invariant_kv_splits(257, 256) == 2
    cache = Cache(torch.Generator().manual_seed(0), torch.float32, [10])
    with pytest.raises(ValueError, match="multiple of"):
        cache.run([(1, 10, torch.zeros(1, H, R + P))], split_size=40)
