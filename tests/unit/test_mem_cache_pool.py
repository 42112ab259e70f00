"""ReqToTokenPool and MLATokenToKVPool."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_alloc_free_clear():
    pool = ReqToTokenPool(size=3, max_context_len=16)
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int64
    rows = pool.alloc(2)
    assert len(rows) == 2 and len(set(rows)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    last = pool.alloc()
    assert set(rows + last) == {0, 1, 2}
    pool.free(rows[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[0])
    pool.free([rows[1]] + last)
    assert pool.available_size() == 3
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3


def _pool(dtype: torch.dtype = torch.float32) -> MLATokenToKVPool:
    # 2 main layers + 1 MTP layer share the pool.
    return MLATokenToKVPool(
        size=8, page_size=4, dtype=dtype, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=3
    )


def test_mla_pool_shapes_and_mem_usage():
    pool = _pool(torch.bfloat16)
    for layer in range(3):
        assert pool.get_key_buffer(layer).shape == (12, 1, 8)
        assert pool.get_c_kv(layer).shape == (12, 1, 6)
        assert pool.get_k_pe(layer).shape == (12, 1, 2)
    assert pool.mem_usage_bytes() == 3 * 12 * 8 * 2
    with pytest.raises(IndexError):
        pool.get_key_buffer(3)


def test_mla_pool_write_casts_and_views_alias():
    pool = _pool(torch.bfloat16)
    loc = torch.tensor([4, 9])
    c_kv = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    k_pe = -torch.arange(1, 5, dtype=torch.float32).reshape(2, 2)
    pool.set_mla_kv_buffer(2, loc, c_kv, k_pe)  # the MTP layer
    buf = pool.get_key_buffer(2)
    assert buf.dtype == torch.bfloat16
    assert torch.equal(buf[loc, 0, :6].float(), c_kv)
    assert torch.equal(pool.get_k_pe(2)[loc, 0].float(), k_pe)
    assert torch.equal(pool.get_c_kv(2)[loc, 0].float(), c_kv)
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched
    others = [i for i in range(12) if i not in (4, 9)]
    assert buf[others].abs().sum() == 0
    pool.get_c_kv(2)[4] = 7.0  # views alias the buffer
    assert bool((buf[4, 0, :6] == 7).all())


def test_mla_pool_padding_slot_accepts_duplicate_writes():
    pool = _pool()
    loc = torch.tensor([0, 0, 5])  # padded batch: two rows write the padding slot
    pool.set_mla_kv_buffer(0, loc, torch.ones(3, 1, 6), torch.ones(3, 1, 2))
    assert bool((pool.get_key_buffer(0)[5] == 1).all())


def test_mla_pool_separate_layout_holds_two_contiguous_caches():
    """The layout FIA's MLA path takes on NPU: latent and rope key in their own contiguous
    buffers, read through the same accessors; the data is the interleaved pool's."""
    pools = {
        layout: MLATokenToKVPool(8, 4, torch.float32, 6, 2, layer_num=3, layout=layout)
        for layout in ("interleaved", "separate")
    }
    loc = torch.tensor([4, 9, 0, 0])
    c_kv, k_pe = torch.randn(4, 1, 6), torch.randn(4, 2)
    for pool in pools.values():
        pool.set_mla_kv_buffer(1, loc[:2], c_kv[:2], k_pe[:2])
    inter, sep = pools["interleaved"], pools["separate"]
    for layer in range(3):
        assert sep.get_c_kv(layer).is_contiguous() and sep.get_k_pe(layer).is_contiguous()
        assert not inter.get_c_kv(layer).is_contiguous()
        assert torch.equal(sep.get_c_kv(layer), inter.get_c_kv(layer))
        assert torch.equal(sep.get_k_pe(layer), inter.get_k_pe(layer))
        assert torch.equal(sep.get_key_buffer(layer), inter.get_key_buffer(layer))
    assert sep.get_c_kv(0).data_ptr() != sep.get_c_kv(1).data_ptr()
    assert sep.mem_usage_bytes() == inter.mem_usage_bytes() == 3 * 12 * 8 * 4
    slots = torch.tensor([[4, 9, 0], [9, 9, 4]])
    for pool in pools.values():
        rows = pool.gather_kv(1, slots)
        assert rows.shape == (2, 3, 8)
        assert torch.equal(rows[0, 1], torch.cat([c_kv[1, 0], k_pe[1]]))
        assert torch.equal(rows[0, 2], torch.zeros(8))
    # The separate layout's joint buffer is a snapshot; its caches are the storage.
    sep.get_key_buffer(1)[4] = 0.0
    assert torch.equal(sep.get_c_kv(1)[4, 0], c_kv[0, 0])
    sep.get_k_pe(1)[9] = 5.0
    assert bool((sep.gather_kv(1, torch.tensor([9]))[0, 6:] == 5).all())
    with pytest.raises(ValueError, match="unknown KV layout"):
        MLATokenToKVPool(8, 4, torch.float32, 6, 2, layer_num=1, layout="paged")
    with pytest.raises(IndexError):
        sep.gather_kv(3, slots)
