"""`ModelRunner.write_mtp_kv`: the MTP pass that nobody drafts from (a K = 0 request's
deferred positions caught up as it finishes or leaves, a prefill chunk that completes no
prompt) writes only the KV, and the bits are those the whole MTP layer's forward writes."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import ServerArgs


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request, tiny_mtp_factory) -> ModelRunner:
    args = ServerArgs(
        model_path=tiny_mtp_factory(num_mtp=2).path,
        dtype=request.param,
        context_length=64,
        max_running_requests=16,
        max_total_tokens=1024,
        speculative_algorithm="MTP",
        speculative_num_steps=2,
    )
    return ModelRunner(args, get_platform("cpu"))


def _extend_batch(runner: ModelRunner, seed: int):
    """A DRAFT_EXTEND batch of three requests with cached prefixes of random KV and 1, 4
    and 7 new positions, and the target hidden states at them."""
    g = torch.Generator().manual_seed(seed)
    pool, prefixes, news = runner.kv_pool, [3, 9, 0], [1, 4, 7]
    rows = runner.req_to_token_pool.alloc(len(news))
    locs = []
    for row, prefix, new in zip(rows, prefixes, news):
        slots = runner.allocator.alloc(prefix + new)
        runner.req_to_token_pool.req_to_token[row, : prefix + new] = slots
        for layer in range(pool.layer_num):
            c_kv = torch.randn(prefix + new, pool.kv_lora_rank, generator=g)
            k_pe = torch.randn(prefix + new, pool.qk_rope_head_dim, generator=g)
            pool.set_mla_kv_buffer(layer, slots, c_kv, k_pe)
        locs.append(slots[prefix:])
    ids = torch.randint(3, runner.vocab_size, (sum(news),), generator=g).tolist()
    seq = [p + n for p, n in zip(prefixes, news)]
    loc = torch.cat(locs)
    fb = lambda: runner.build_forward_batch(  # noqa: E731
        ForwardMode.DRAFT_EXTEND, ids, rows, seq, news, loc
    )
    hidden = torch.randn(sum(news), runner.config.hidden_size, generator=g)
    return fb, hidden.to(runner.dtype), loc


def _kv(runner: ModelRunner, layer: int, loc: torch.Tensor):
    pool = runner.kv_pool
    return pool.get_c_kv(layer)[loc].clone(), pool.get_k_pe(layer)[loc].clone()


@pytest.mark.parametrize("mtp_layer", [0, 1])
def test_kv_only_pass_writes_the_forward_bits(runner, mtp_layer):
    fb, hidden, loc = _extend_batch(runner, seed=mtp_layer)
    layer_id = runner.mtp.first_layer_id + mtp_layer
    before = _kv(runner, layer_id, loc)
    runner.forward_eager(fb(), mtp_step=mtp_layer, hidden=hidden)
    forward = _kv(runner, layer_id, loc)
    assert not torch.equal(forward[0], before[0])  # the forward wrote these slots
    pool = runner.kv_pool
    pool.set_mla_kv_buffer(layer_id, loc, *before)  # back to what they held
    others = [_kv(runner, i, loc) for i in range(pool.layer_num) if i != layer_id]
    runner.write_mtp_kv(fb(), hidden, mtp_layer)
    assert all(torch.equal(a, b) for a, b in zip(_kv(runner, layer_id, loc), forward))
    # no other layer's KV touched
    after = [_kv(runner, i, loc) for i in range(pool.layer_num) if i != layer_id]
    assert all(torch.equal(x, y) for a, b in zip(others, after) for x, y in zip(a, b))
