"""The plain-torch FIA reference against a dense per-request attention, plus its validation."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from srt_ascend.layers.attention import npu_ops
from srt_ascend.layers.attention.fia_backend import _fia_mla_in_graph, paged_cache
from srt_ascend.layers.attention.fia_reference import (
    MASK_SIZE,
    build_compressed_causal_mask,
    mla_npu_shape_problems,
    npu_fused_infer_attention_score,
    to_cumulative,
)
from srt_ascend.mem_cache import MLATokenToKVPool

RAGGED_Q = [1, 16, 3, 2, 7, 1, 16, 5]
RAGGED_KV = [1, 40, 3, 17, 9, 64, 16, 33]  # crosses page boundaries for block sizes 4 and 16


def make_case(
    q_lens,
    kv_lens,
    block_size,
    *,
    num_heads=4,
    kv_heads=1,
    d=16,
    dr=8,
    dtype=torch.float32,
    cache_4d=False,
    rope=True,
    seed=0,
):
    """Random MLA inputs: a shuffled paged cache holding each request's contiguous KV.

    Returns (kwargs for the op, dense per-request tensors for the reference)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    pages = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    latent = rand(num_blocks, block_size, kv_heads, d)  # garbage outside the requests' slots
    k_pe = rand(num_blocks, block_size, kv_heads, dr)
    table = torch.full((len(q_lens), max(pages, default=0) + 2), -1, dtype=torch.int32)
    dense_kv, dense_pe = [], []
    for b, kv in enumerate(kv_lens):
        ids = [order.pop() for _ in range(pages[b])]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots = [(ids[p // block_size], p % block_size) for p in range(kv)]
        dense_kv.append(torch.stack([latent[i, o] for i, o in slots]) if slots else None)
        dense_pe.append(torch.stack([k_pe[i, o] for i, o in slots]) if slots else None)
    total = sum(q_lens)
    kwargs = dict(
        query=rand(total, num_heads, d),
        key=_layout(latent, cache_4d),
        value=_layout(latent, cache_4d),
        query_rope=rand(total, num_heads, dr) if rope else None,
        key_rope=_layout(k_pe, cache_4d) if rope else None,
        atten_mask=build_compressed_causal_mask(),
        actual_seq_lengths=to_cumulative(q_lens),
        actual_seq_lengths_kv=list(kv_lens),
        block_table=table,
        num_heads=num_heads,
        num_key_value_heads=kv_heads,
        scale=1.0 / math.sqrt(d + dr),
        input_layout="TND",
        block_size=block_size,
        sparse_mode=3,
    )
    return kwargs, (dense_kv, dense_pe)


def _layout(cache, cache_4d):
    """[NB, bs, kvN, D] -> (NB, kvN, bs, D) or (NB, bs, kvN * D), as the op accepts."""
    if cache_4d:
        return cache.permute(0, 2, 1, 3).contiguous()
    return cache.flatten(2)


def dense_attention(kwargs, dense, causal=True):
    """Per request, per query, per head: softmax over the visible contiguous keys in float64."""
    dense_kv, dense_pe = dense
    q, q_pe = kwargs["query"].double(), kwargs["query_rope"]
    ends = kwargs["actual_seq_lengths"]
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = kwargs["num_heads"] // kwargs["num_key_value_heads"]
    for b, end in enumerate(ends):
        start = ends[b - 1] if b else 0
        q_len, kv_len = end - start, kwargs["actual_seq_lengths_kv"][b]
        for i in range(q_len):
            visible = kv_len - q_len + i + 1 if causal else kv_len
            if visible <= 0:
                continue
            for h in range(q.shape[1]):
                k = dense_kv[b][:visible, h // group].double()
                s = k @ q[start + i, h]
                if q_pe is not None:
                    s = s + dense_pe[b][:visible, h // group].double() @ q_pe[start + i, h].double()
                p = torch.softmax(s * kwargs["scale"], dim=0)
                out[start + i, h] = p @ k
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
@pytest.mark.parametrize("cache_4d", [False, True])
def test_matches_dense_float32(block_size, cache_4d):
    kwargs, dense = make_case(RAGGED_Q, RAGGED_KV, block_size, cache_4d=cache_4d, seed=block_size)
    out, lse = npu_fused_infer_attention_score(**kwargs)
    assert out.shape == (sum(RAGGED_Q), 4, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)
    assert lse.shape == (1,) and lse.dtype == torch.float32 and lse.item() == 0


@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_dense_bfloat16(block_size):
    kwargs, dense = make_case(RAGGED_Q, RAGGED_KV, block_size, dtype=torch.bfloat16, seed=7)
    out, _ = npu_fused_infer_attention_score(**kwargs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=2e-2, rtol=2e-2)


def test_grouped_kv_heads_without_rope_and_lse():
    kwargs, dense = make_case([2, 5, 1], [2, 11, 6], 4, num_heads=6, kv_heads=2, rope=False)
    out, lse = npu_fused_infer_attention_score(**kwargs, softmax_lse_flag=True)
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)
    assert lse.shape == (8, 6, 1)
    # lse of the last query of request 0 (q_len 2, kv_len 2) sees both keys: check one head.
    k = dense[0][0][:, 0].double()
    s = k @ kwargs["query"][1, 0].double() * kwargs["scale"]
    torch.testing.assert_close(lse[1, 0, 0].double(), torch.logsumexp(s, 0), atol=1e-5, rtol=0)


def test_tnd_ntd_layout_is_transposed_tnd():
    kwargs, _ = make_case(RAGGED_Q, RAGGED_KV, 4)
    tnd, _ = npu_fused_infer_attention_score(**kwargs)
    ntd, _ = npu_fused_infer_attention_score(**{**kwargs, "input_layout": "TND_NTD"})
    assert ntd.shape == (4, sum(RAGGED_Q), 16)
    torch.testing.assert_close(ntd, tnd.transpose(0, 1))


def test_vllm_int8_mask_and_leading_dims_match_bool_mask():
    kwargs, _ = make_case(RAGGED_Q, RAGGED_KV, 4)
    ref, _ = npu_fused_infer_attention_score(**kwargs)
    int8_mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE), diagonal=1).to(torch.int8)
    for mask in (int8_mask, int8_mask[None, None].to(torch.uint8)):
        out, _ = npu_fused_infer_attention_score(**{**kwargs, "atten_mask": mask})
        torch.testing.assert_close(out, ref)


def test_decode_sparse0_without_mask_equals_causal():
    kwargs, dense = make_case([1, 1, 1], [5, 1, 30], 4)
    causal, _ = npu_fused_infer_attention_score(**kwargs)
    plain, _ = npu_fused_infer_attention_score(**{**kwargs, "sparse_mode": 0, "atten_mask": None})
    torch.testing.assert_close(plain, causal)
    torch.testing.assert_close(plain.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)


def test_sparse0_multi_query_without_rope_is_not_causal():
    kwargs, dense = make_case([3, 4], [3, 9], 4, rope=False)
    kwargs.update(sparse_mode=0, atten_mask=None)
    out, _ = npu_fused_infer_attention_score(**kwargs)
    full = dense_attention(kwargs, dense, causal=False)
    torch.testing.assert_close(out.double(), full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full, dense_attention(kwargs, dense, causal=True))


def test_graph_padding_rows_give_zeros_and_leave_real_rows_alone():
    # DESIGN section 8: padded requests carry 0 KV tokens; some carry 1+k queries, some none.
    q_lens, kv_lens = [2, 3, 0, 2, 4], [9, 3, 0, 0, 0]
    kwargs, dense = make_case(q_lens, kv_lens, 4, seed=3)
    out, _ = npu_fused_infer_attention_score(**kwargs)
    assert torch.count_nonzero(out[5:]) == 0
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)
    real, real_dense = make_case(q_lens[:2], kv_lens[:2], 4, seed=3)
    real["query"], real["query_rope"] = kwargs["query"][:5], kwargs["query_rope"][:5]
    real_out, _ = npu_fused_infer_attention_score(**real)
    torch.testing.assert_close(real_out, out[:5])


def test_batch_of_only_padding_requests():
    kwargs, _ = make_case([2, 3, 0], [0, 0, 0], 4)
    out, _ = npu_fused_infer_attention_score(**kwargs)
    assert out.shape == (5, 4, 16) and torch.count_nonzero(out) == 0


def test_empty_batch():
    kwargs, _ = make_case([], [], 4)
    out, _ = npu_fused_infer_attention_score(**kwargs)
    assert out.shape == (0, 4, 16)


def test_chunked_requests_match_single_chunk(monkeypatch):
    from srt_ascend.layers.attention import fia_plans

    kwargs, _ = make_case(RAGGED_Q, RAGGED_KV, 4, seed=5)
    whole, _ = npu_fused_infer_attention_score(**kwargs)
    monkeypatch.setattr(fia_plans, "_SCORE_BUDGET", 1)  # one request per chunk
    torch.testing.assert_close(npu_fused_infer_attention_score(**kwargs)[0], whole)


def _bad(**changes):
    kwargs, _ = make_case([2, 3], [5, 8], 4)
    return {**kwargs, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(input_layout="BSH"), "input_layout must be one of"),
        (dict(input_layout="NTD_TND"), "input_layout must be one of"),
        (dict(actual_seq_lengths=[3, 2]), "must be cumulative"),
        (dict(actual_seq_lengths=[2, 4]), "must end at T=5"),
        (dict(actual_seq_lengths=None), "actual_seq_lengths is required"),
        (dict(actual_seq_lengths_kv=[5, 8, 1]), "actual_seq_lengths_kv has 3"),
        (dict(atten_mask=None), "sparse_mode=3 requires atten_mask"),
        (dict(atten_mask=torch.ones(16, 16).triu(1).bool()), "atten_mask of shape"),
        (dict(atten_mask=~build_compressed_causal_mask()), "must be upper-triangular"),
        (dict(atten_mask=torch.zeros(MASK_SIZE, MASK_SIZE)), "dtype must be bool"),
        (dict(sparse_mode=2), "sparse_mode must be 0"),
        (dict(sparse_mode=0), "takes no atten_mask"),
        (dict(sparse_mode=0, atten_mask=None), "needs sparse_mode=3"),
        (dict(actual_seq_lengths_kv=[1, 8]), "only 1 KV tokens"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "needs 2 blocks"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "2-D int32"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), "3 rows for 2 requests"),
        (dict(block_table=torch.full((2, 4), 99, dtype=torch.int32)), "block ids outside"),
        (dict(block_table=None), "block_table is required"),
        (dict(block_size=16), "block_size=16 must be > 0 and match"),
        (dict(query_rope=None), "given together"),
        (dict(num_heads=8), "num_heads=8"),
        (dict(num_key_value_heads=3), "must be a multiple"),
        (dict(antiquant_mode=1), "antiquantisation"),
        (dict(antiquant_scale=torch.ones(2)), "antiquantisation"),
        (dict(softmax_lse_flag=True), "softmax_lse_flag=True is not supported"),
        (dict(pse_shift=torch.zeros(1)), "pse_shift=.* is not supported"),
        (dict(key_antiquant_mode=1), "key_antiquant_mode=1 is not supported"),
        (dict(inner_precise=7), "inner_precise must be"),
    ],
)
def test_validation_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        npu_fused_infer_attention_score(**_bad(**changes))


def test_more_than_16_query_tokens_per_request():
    kwargs, _ = make_case([17], [20], 4)
    with pytest.raises(ValueError, match="at most 16 query tokens per request"):
        npu_fused_infer_attention_score(**kwargs)


def test_value_and_key_shapes_must_match():
    kwargs = _bad()
    with pytest.raises(ValueError, match="key and value must share one paged shape"):
        npu_fused_infer_attention_score(**{**kwargs, "value": kwargs["value"][:-1]})


def test_keywords_the_op_lacks_or_tolerates():
    with pytest.raises(TypeError, match="unexpected keyword 'softmax_scale'"):
        npu_fused_infer_attention_score(**_bad(softmax_scale=0.1))
    with pytest.raises(TypeError, match="host list"):
        npu_fused_infer_attention_score(**_bad(actual_seq_lengths=torch.tensor([2, 5])))
    ok, _ = npu_fused_infer_attention_score(**_bad(pre_tokens=65535, next_tokens=0, pse_shift=None))
    torch.testing.assert_close(ok, npu_fused_infer_attention_score(**_bad())[0])


def test_helpers():
    mask = build_compressed_causal_mask()
    assert mask.shape == (MASK_SIZE, MASK_SIZE) and mask.dtype == torch.bool
    assert not mask[5, 5] and mask[5, 6] and not mask[6, 5]
    assert int(mask.sum()) == MASK_SIZE * (MASK_SIZE - 1) // 2
    assert to_cumulative([2, 0, 3]) == [2, 2, 5] and to_cumulative([]) == []
    with pytest.raises(ValueError):
        to_cumulative([1, -1])
    assert mla_npu_shape_problems(128, 512, 64, 128) == []
    assert len(mla_npu_shape_problems(4, 16, 8, 4)) == 4


def test_dispatch_uses_reference_off_npu():
    kwargs, _ = make_case(RAGGED_Q, RAGGED_KV, 4)
    direct, _ = npu_fused_infer_attention_score(**kwargs)
    via, _ = npu_ops.fused_infer_attention_score(**kwargs)
    torch.testing.assert_close(via, direct)
    assert npu_ops.resolve_fused_infer_attention_score("cpu") is npu_fused_infer_attention_score


def test_dispatch_imports_torch_npu_only_for_npu(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = lambda *a, **k: ("npu", a, k)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    impl = npu_ops.resolve_fused_infer_attention_score("npu")
    assert impl is fake.npu_fused_infer_attention_score


@pytest.mark.npu
def test_real_op_matches_reference_on_npu():
    torch_npu = pytest.importorskip("torch_npu")
    if not torch_npu.npu.is_available():
        pytest.skip("no Ascend NPU")
    kwargs, _ = make_case(
        [2, 4, 1],
        [130, 7, 300],
        128,
        num_heads=32,
        d=512,
        dr=64,
        dtype=torch.bfloat16,
        cache_4d=True,
    )
    expected, _ = npu_fused_infer_attention_score(**kwargs)
    on_npu = {k: v.npu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    on_npu["atten_mask"] = on_npu["atten_mask"].to(torch.int8)
    out, _ = npu_ops.fused_infer_attention_score(**on_npu)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
def test_latent_and_rope_in_one_buffer_match_dense(block_size):
    """How the FIA backend passes the cache: key = value = buf[..., :D] and key_rope =
    buf[..., D:] of one [slots, 1, D + Dr] buffer (the reference then gathers it once)."""
    kwargs, dense = make_case(RAGGED_Q, RAGGED_KV, block_size, seed=11)
    key, rope = kwargs["key"], kwargs["key_rope"]  # (NB, bs, D), (NB, bs, Dr)
    buf = torch.cat([key, rope], dim=-1).view(-1, 1, key.shape[-1] + rope.shape[-1])
    paged = buf.view(key.shape[0], block_size, -1)
    d = key.shape[-1]
    joint = {**kwargs, "key": paged[..., :d], "value": paged[..., :d], "key_rope": paged[..., d:]}
    out, _ = npu_fused_infer_attention_score(**joint)
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)


def test_block_table_changed_in_place_between_calls():
    """Index plans are reused across calls only for an equal block table: the same table
    object rewritten in place (same lengths, so the same cache key) must be re-planned."""
    kwargs, _ = make_case([2, 2], [4, 4], 1, seed=3)
    first, _ = npu_fused_infer_attention_score(**kwargs)
    table = kwargs["block_table"]
    table[[0, 1]] = table[[1, 0]].clone()  # the two requests now read each other's KV
    in_place, _ = npu_fused_infer_attention_score(**kwargs)
    fresh, _ = npu_fused_infer_attention_score(**{**kwargs, "block_table": table.clone()})
    assert not torch.allclose(in_place, first)
    torch.testing.assert_close(in_place, fresh)


def test_repeated_calls_are_checked_again_when_anything_checked_changes():
    """Identical calls (each layer of a forward) skip the argument checks after the first;
    any change to what the checks read, in place included, is checked again."""
    kwargs, _ = make_case([2, 3], [5, 8], 4)
    npu_fused_infer_attention_score(**kwargs)
    npu_fused_infer_attention_score(**kwargs)
    with pytest.raises(ValueError, match="sparse_mode=3 requires atten_mask"):
        npu_fused_infer_attention_score(**{**kwargs, "atten_mask": None})
    kwargs["actual_seq_lengths_kv"][0] = 1  # the same list object, now invalid
    with pytest.raises(ValueError, match="only 1 KV tokens"):
        npu_fused_infer_attention_score(**kwargs)
    kwargs["actual_seq_lengths_kv"][0] = 5
    npu_fused_infer_attention_score(**kwargs)
    kwargs["actual_seq_lengths_kv"][0] = 5.0  # equal as a number, but not an int
    with pytest.raises(TypeError, match="must contain ints"):
        npu_fused_infer_attention_score(**kwargs)
    kwargs["actual_seq_lengths_kv"][0] = 5
    npu_fused_infer_attention_score(**kwargs)
    kwargs["atten_mask"].logical_not_()  # the same mask object, inverted in place
    with pytest.raises(ValueError, match="must be upper-triangular"):
        npu_fused_infer_attention_score(**kwargs)


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_kv_pool_caches_as_the_backend_passes_them(block_size, layout):
    """key = value = the pool's latent cache and key_rope = its rope cache, paged as the FIA
    backend pages them (separate layout: contiguous, as the NPU op takes them)."""
    kwargs, dense = make_case(RAGGED_Q, RAGGED_KV, block_size, seed=12)
    key, rope = kwargs["key"], kwargs["key_rope"]  # (NB, bs, D), (NB, bs, Dr)
    d, dr = key.shape[-1], rope.shape[-1]
    slots = key.shape[0] * block_size
    pool = MLATokenToKVPool(slots - block_size, block_size, key.dtype, d, dr, 1, layout=layout)
    pool.set_mla_kv_buffer(0, torch.arange(slots), key.reshape(slots, d), rope.reshape(slots, dr))
    latent = paged_cache(pool.get_c_kv(0), block_size, key.dtype)
    key_rope = paged_cache(pool.get_k_pe(0), block_size, key.dtype)
    assert latent.is_contiguous() == key_rope.is_contiguous() == (layout == "separate")
    out, _ = npu_fused_infer_attention_score(
        **{**kwargs, "key": latent, "value": latent, "key_rope": key_rope}
    )
    torch.testing.assert_close(out.double(), dense_attention(kwargs, dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_compiled_forms_attention_matches_the_reference_with_padding_rows(layout):
    """The tensor-op form a compiled forward runs off NPU (fia_backend._fia_mla_in_graph):
    the reference's output for ragged requests of at most max_q tokens, and zeros for padding
    requests (KV length 0), including one holding more than max_q tokens (a spare slot)."""
    block_size, q_lens, kv_lens = 4, [3, 1, 2, 0, 5], [40, 9, 17, 0, 0]
    kwargs, _ = make_case(q_lens, kv_lens, block_size, seed=13)
    key, rope = kwargs["key"], kwargs["key_rope"]
    d, dr = key.shape[-1], rope.shape[-1]
    slots = key.shape[0] * block_size
    pool = MLATokenToKVPool(slots - block_size, block_size, key.dtype, d, dr, 1, layout=layout)
    pool.set_mla_kv_buffer(0, torch.arange(slots), key.reshape(slots, d), rope.reshape(slots, dr))
    want, _ = npu_fused_infer_attention_score(**kwargs)
    got = _fia_mla_in_graph(
        kwargs["query"],
        kwargs["query_rope"],
        pool,
        0,
        kwargs["block_table"],
        torch.tensor(q_lens),
        torch.tensor(kv_lens),
        kwargs["scale"],
        block_size,
        max_q=3,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[6:].abs().max() == 0  # the padding requests' 5 tokens
