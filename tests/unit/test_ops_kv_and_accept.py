"""KV store, req_to_token assignment and chain acceptance: Triton kernels (interpreter) vs
their torch references, and acceptance vs `speculative.acceptance` (bit-identical tokens)."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.ops import kv_cache, spec_accept
from srt_ascend.speculative import acceptance
from tests.unit.triton_interpreter import import_interpreted

_, kv_triton, accept_triton, _ = import_interpreted()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_buffers", [False, True])
def test_store_kv(dtype, split_buffers):
    gen = torch.Generator().manual_seed(0)
    n, r, p, slots = 11, 32, 8, 64
    if split_buffers:
        bufs = [torch.zeros(slots, 1, r, dtype=dtype), torch.zeros(slots, 1, p, dtype=dtype)]
        refs = [b.clone() for b in bufs]
    else:
        whole, whole_ref = torch.zeros(2, slots, 1, r + p, dtype=dtype)
        bufs = [whole[..., :r], whole[..., r:]]
        refs = [whole_ref[..., :r], whole_ref[..., r:]]
    loc = torch.randperm(slots, generator=gen)[:n]
    c_kv, k_pe = torch.randn(n, r, generator=gen), torch.randn(n, 1, p, generator=gen)
    kv_triton.store_kv(*bufs, loc, c_kv, k_pe)  # float32 inputs cast to the cache dtype
    kv_cache.store_kv_reference(*refs, loc, c_kv, k_pe)
    assert torch.equal(bufs[0], refs[0]) and torch.equal(bufs[1], refs[1])
    assert bufs[0].abs().sum() > 0


@pytest.mark.parametrize("batch", [1, 4, 9])
def test_assign_req_to_token(batch):
    gen = torch.Generator().manual_seed(batch)
    starts = torch.randint(0, 200, (batch,), generator=gen)
    ends = starts + torch.randint(0, 150, (batch,), generator=gen)
    rows = torch.randperm(12, generator=gen)[:batch]
    loc = torch.randint(1, 10_000, (int((ends - starts).sum()),), generator=gen)
    r2t, r2t_ref = torch.full((2, 12, 400), -7, dtype=torch.int64)
    kv_triton.assign_req_to_token(r2t, rows, starts, ends, loc)
    kv_cache.assign_req_to_token_reference(r2t_ref, rows, starts, ends, loc)
    assert torch.equal(r2t, r2t_ref)
    kv_cache.assign_req_to_token(r2t_ref, rows, starts, ends, loc)  # CPU dispatch: reference


def random_chain(gen, batch, k, vocab, dtype):
    """Drafts with distributions where acceptance is neither certain nor hopeless, one-hot
    (greedy) draft rows, zero target mass on some drafts, and one row whose draft and target
    agree exactly (the all-zero residual falls back to p_t)."""
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    temp = torch.rand(batch, 1, 1, generator=gen) * 4 + 0.5
    p_d = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * temp, -1)
    p_t = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * temp, -1)
    p_d.scatter_(-1, drafts[..., None], torch.rand(batch, k, 1, generator=gen))
    p_t[:, :k].scatter_(-1, drafts[..., None], torch.rand(batch, k, 1, generator=gen))
    p_d[0] = torch.nn.functional.one_hot(drafts[0], vocab).float()  # greedy draft row
    if batch > 2:
        p_t[1, 0, drafts[1, 0]] = 0.0  # target gives the draft no mass: always rejected
    if batch > 3:
        p_t[2, :k] = p_d[2]
        p_t[2, 0, drafts[2, 0]] = p_d[2, 0, drafts[2, 0]] = 0.0  # rejected, residual all zero
    p_d, p_t = p_d / p_d.sum(-1, keepdim=True), p_t / p_t.sum(-1, keepdim=True)
    uniforms = 1.0 - torch.rand(batch, k + 1, generator=gen)
    return drafts, p_d.to(dtype), p_t.to(dtype), uniforms


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rejection_sample_bit_identical(k, dtype):
    gen = torch.Generator().manual_seed(100 + k)
    accepted = []
    for batch, vocab in ((9, 64), (5, 1500)):
        for _ in range(3):
            chain = random_chain(gen, batch, k, vocab, dtype)
            accept_len, emitted = accept_triton.rejection_sample(*chain)
            ref_len, ref_emitted = spec_accept.rejection_sample_reference(*chain)
            torch_rule = acceptance.rejection_sample(*chain[:3], uniforms=chain[3])
            assert torch.equal(accept_len, ref_len) and torch.equal(emitted, ref_emitted)
            assert torch.equal(accept_len, torch_rule.accept_len)
            assert torch.equal(emitted, torch_rule.emitted)
            accepted += accept_len.tolist()
    assert 0 in accepted and len(set(accepted)) > 1  # rejections and acceptances both seen


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_accept_bit_identical(k):
    gen = torch.Generator().manual_seed(k)
    drafts = torch.randint(0, 3, (9, k), generator=gen)
    target = torch.randint(0, 3, (9, k + 1), generator=gen)
    target[0, :k] = drafts[0]  # one row accepts everything
    accept_len, emitted = accept_triton.greedy_accept(drafts, target)
    rule = acceptance.greedy_accept(drafts, target)
    assert torch.equal(accept_len, rule.accept_len) and torch.equal(emitted, rule.emitted)
    ref = spec_accept.greedy_accept_reference(drafts, target)
    assert torch.equal(accept_len, ref[0]) and torch.equal(emitted, ref[1])
    assert accept_len[0] == k
    dispatched = spec_accept.greedy_accept(drafts, target)  # CPU: the reference
    assert torch.equal(dispatched[1], emitted)
