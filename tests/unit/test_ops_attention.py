"""Paged MLA attention: the Triton kernel (under the interpreter) against its torch reference,
and the reference against the torch_native backend.

Random cases over page sizes 1 / 16 / 64 (slots handed out page by page in shuffled page
order), decode, both verify layouts with K = 1..4, extend with ragged cached prefixes, batch
1..9, split-KV, fp32 and bf16, and c_kv / k_pe as views of one buffer or two buffers.
Tolerances: fp32 1e-5 (same float32 math, another summation order); bf16 one bf16 step of
the output (2e-2 absolute for outputs of magnitude <= 2, rtol 1.6e-2).
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.ops.mla_attention import mla_attention, mla_attention_reference
from tests.unit.triton_interpreter import import_interpreted

attn_triton, _, _, _ = import_interpreted()
H, R, P = 4, 32, 8
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def make_case(gen, q_lens, prefix_lens, page_size, dtype, split_buffers, shared_row=False):
    """Rows with q_lens[b] queries after prefix_lens[b] cached tokens. shared_row: all rows
    read one request row (batch-expanded verify)."""
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    pages = 1 + sum(-(-s // page_size) for s in seq_lens)
    slots = pages * page_size
    if split_buffers:
        c_kv = torch.randn(slots, 1, R, generator=gen).to(dtype)
        k_pe = torch.randn(slots, 1, P, generator=gen).to(dtype)
    else:
        buf = torch.randn(slots, 1, R + P, generator=gen).to(dtype)
        c_kv, k_pe = buf[..., :R], buf[..., R:]
    order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()  # page 0: padding
    r2t = torch.zeros(len(q_lens) + 1, max(seq_lens) + 1, dtype=torch.int64)
    rows = [1] * len(q_lens) if shared_row else list(range(1, len(q_lens) + 1))
    for b, s in enumerate(seq_lens):
        if shared_row and b:
            continue
        n = -(-s // page_size)
        row_pages = torch.tensor([order.pop() for _ in range(n)])
        r2t[rows[b], :s] = (row_pages[:, None] * page_size + torch.arange(page_size)).flatten()[:s]
    t = sum(q_lens)
    q_latent = torch.randn(t, H, R, generator=gen).to(dtype)
    q_pe = torch.randn(t, H, P, generator=gen).to(dtype)
    q_lens_t = torch.tensor(q_lens)
    starts = torch.cumsum(q_lens_t, 0) - q_lens_t
    return (q_latent, q_pe, c_kv, k_pe, r2t, torch.tensor(rows), torch.tensor(seq_lens),
            q_lens_t, starts, 0.3)  # fmt: skip


def check(args, dtype, splits=1):
    ref = mla_attention_reference(*args)
    q_lens = args[7].tolist()
    out = attn_triton.mla_attention(*args, max_q_len=max(q_lens), num_kv_splits=splits)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    return ref


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    for batch in (1, 4, 9):
        prefix = torch.randint(0, 150, (batch,), generator=gen).tolist()
        args = make_case(gen, [1] * batch, prefix, page_size, dtype, split_buffers=batch == 4)
        check(args, dtype, splits=1 if batch == 9 else 3)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verify_both_layouts(k):
    """Multi-query rows (K+1 queries each) and batch expansion (K+1 one-query rows over one
    request row) give the same outputs for the same tokens."""
    gen = torch.Generator().manual_seed(10 + k)
    for page_size, dtype in ((1, torch.float32), (16, torch.bfloat16), (64, torch.float32)):
        prefix = int(torch.randint(1, 120, (1,), generator=gen))
        multi = make_case(gen, [k + 1], [prefix], page_size, dtype, split_buffers=False)
        ref = check(multi, dtype, splits=2)
        q_lat, q_pe, c_kv, k_pe, r2t = multi[:5]
        expand = (q_lat, q_pe, c_kv, k_pe, r2t, torch.ones(k + 1, dtype=torch.int64),
                  torch.arange(prefix + 1, prefix + k + 2), torch.ones(k + 1, dtype=torch.int64),
                  torch.arange(k + 1), 0.3)  # fmt: skip
        out = attn_triton.mla_attention(*expand, max_q_len=1, num_kv_splits=1)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_with_ragged_prefix(page_size):
    gen = torch.Generator().manual_seed(20 + page_size)
    for dtype in (torch.float32, torch.bfloat16):
        q_lens = [13, 1, 24, 5]
        prefix = [0, 37, 9, 70]
        args = make_case(gen, q_lens, prefix, page_size, dtype, split_buffers=True)
        check(args, dtype, splits=1)
        check(args, dtype, splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_heads_and_latent(dtype):
    """DeepSeek-V3's 128 heads and latent 512 + rope 64 (small KV): decode rows and verify
    rows of K + 1 = 3 queries, one KV part and split, against the reference. The heads fill
    several head blocks of the dtype's tile, each key tile loaded once at the full width."""
    gen = torch.Generator().manual_seed(43)
    h, r, p = 128, 512, 64
    for q_lens, splits in (([1, 1], 2), ([3], 1)):
        prefix = torch.randint(5, 40, (len(q_lens),), generator=gen).tolist()
        seq_lens = [a + b for a, b in zip(prefix, q_lens)]
        buf = torch.randn(sum(seq_lens) + 1, 1, r + p, generator=gen).to(dtype)
        r2t = torch.zeros(len(q_lens), max(seq_lens), dtype=torch.int64)
        perm = (torch.randperm(sum(seq_lens), generator=gen) + 1).split(seq_lens)
        for b, slots in enumerate(perm):
            r2t[b, : seq_lens[b]] = slots
        t = sum(q_lens)
        q_lens_t = torch.tensor(q_lens)
        args = (torch.randn(t, h, r, generator=gen).to(dtype) * 0.05,
                torch.randn(t, h, p, generator=gen).to(dtype) * 0.05, buf[..., :r], buf[..., r:],
                r2t, torch.arange(len(q_lens)), torch.tensor(seq_lens), q_lens_t,
                torch.cumsum(q_lens_t, 0) - q_lens_t, r**-0.5)  # fmt: skip
        check(args, dtype, splits=splits)


def test_plan_tiles():
    """Each GPU's tile: 64 heads per program on Hopper in bf16, 32 elsewhere, 16 in float32;
    verify rows share a head block's tile where the heads leave rows; cached per geometry."""
    plan = attn_triton.plan
    assert plan(128, 1, True, 90, False) == attn_triton.Plan(1, 64, 32, 3, 8)
    assert plan(128, 4, True, 80, False) == attn_triton.Plan(1, 32, 16, 2, 8)
    assert plan(128, 1, False, 90, False) == attn_triton.Plan(1, 16, 16, 2, 4)
    assert plan(16, 4, True, 90, False).block_q * plan(16, 4, True, 90, False).block_h == 64
    assert plan(8, 1, False, 0, False).block_q == 2  # 8 heads x 2 tokens: a dot's 16 rows
    assert plan(128, 1, True, 90, False) is plan(128, 1, True, 90, False)


def test_padding_rows_and_batch_sizes():
    """Rows with seq_len 0 (graph padding) give zeros, as in torch_native."""
    gen = torch.Generator().manual_seed(3)
    for batch in (1, 2, 5, 9):
        prefix = torch.randint(0, 40, (batch,), generator=gen).tolist()
        args = list(make_case(gen, [2] * batch, prefix, 1, torch.float32, split_buffers=False))
        args[6] = args[6].clone()
        args[6][-1] = 0  # the last row is padding: no KV at all
        out = attn_triton.mla_attention(*args, max_q_len=2, num_kv_splits=2)
        ref = mla_attention_reference(*args)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert out[-2:].abs().max() == 0


def test_reference_matches_torch_native_and_dispatch():
    """The op's reference is the torch_native backend's semantics; on CPU `mla_attention`
    dispatches to the reference."""
    from types import SimpleNamespace

    from srt_ascend.layers.attention.torch_native import TorchNativeMLABackend
    from srt_ascend.mem_cache import MLATokenToKVPool

    gen = torch.Generator().manual_seed(5)
    q_lens, prefix = [3, 1, 6], [10, 0, 21]
    args = make_case(gen, q_lens, prefix, 1, torch.float32, split_buffers=False)
    q_lat, q_pe, c_kv, k_pe, r2t, rows, seq_lens, q_lens_t, starts, scale = args
    pool = MLATokenToKVPool(c_kv.shape[0] - 1, 1, torch.float32, R, P, 1)
    pool.get_c_kv(0).copy_(c_kv)
    pool.get_k_pe(0).copy_(k_pe)
    t = sum(q_lens)
    loc = torch.cat([r2t[rows[b], prefix[b] : prefix[b] + q] for b, q in enumerate(q_lens)])
    fb = SimpleNamespace(
        seq_lens=seq_lens, extend_seq_lens=q_lens_t, batch_size=3, static_shapes=False,
        seq_lens_cpu=seq_lens.tolist(), extend_seq_lens_cpu=q_lens, num_tokens=t,
        req_pool_indices=rows, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
        token_to_kv_pool=pool, out_cache_loc=loc,
    )  # fmt: skip
    backend = TorchNativeMLABackend()
    backend.init_forward_metadata(fb)
    new_c, new_pe = c_kv[loc, 0], k_pe[loc, 0]
    native = backend.forward(q_lat, q_pe, new_c, new_pe, 0, scale, fb)
    ref = mla_attention_reference(*args)
    torch.testing.assert_close(native, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mla_attention(*args, max_q_len=6), ref)


def test_kernel_floors_arithmetic():
    """benchmark/kernels.py's floors at issue 43's shape (DeepSeek-V3, batch 32 x KV 4096,
    bf16, H200): the KV read once is 151 MB, 31.46 us at 4.8 TB/s; the dots' 36.5 GFLOP take
    36.9 us at 989 TFLOP/s."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmark" / "kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    hbm, compute = kernels.attention_floors_us(32, 4096)
    assert abs(hbm - 31.457) < 1e-3
    assert abs(compute - 2 * 32 * 128 * 4096 * 1088 / 989e6) < 1e-6
    assert 36.8 < compute < 37.0
    hbm4, compute4 = kernels.attention_floors_us(32, 4096, q=4)  # verify: 4 queries per row
    assert hbm4 == hbm and abs(compute4 - 4 * compute) < 1e-6
