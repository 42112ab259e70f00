"""The DeepSeek-V3 MTP module against an independent re-computation.

The reference is written out here: its own RMSNorm, its own concat + eh_proj, the decoder
block run by transformers' DeepseekV3DecoderLayer holding the same weights (see
tests/conftest.py: the MTP block weights are a deeper HF model's layer L), its own
shared_head norm and the HF main model's LM head. The module must also share the main model's
embedding and head (not copies), repeat its last layer for later draft steps, and keep its KV
in layer id num_hidden_layers of the paged pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt_ascend.layers.attention.torch_native import TorchNativeMLABackend
from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.models.loader import load_model

TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(ck, layer: int, next_tokens, hidden, positions):
    """MTP layer `layer` by hand. next_tokens [B, S] (token t+1), hidden [B, S, d] (h_t),
    positions [S] (t). Returns (output hidden, logits), both [B, S, ...]."""
    hf, block = ck.hf_model, ck.hf_blocks[layer]
    w = {
        k.split(".", 3)[3]: v
        for k, v in ck.mtp_tensors.items()
        if k.startswith(f"model.layers.{ck.config['num_hidden_layers'] + layer}.")
    }
    with torch.no_grad():
        e = hf.model.embed_tokens.weight[next_tokens]
        x = torch.cat([rms_norm(e, w["enorm.weight"]), rms_norm(hidden, w["hnorm.weight"])], -1)
        x = F.linear(x, w["eh_proj.weight"])
        s = positions.shape[0]
        pos = positions[None].expand(x.shape[0], s)
        cos_sin = hf.model.rotary_emb(x, pos)
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        y = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = rms_norm(y, w["shared_head.norm.weight"])
        return out, F.linear(out, hf.lm_head.weight)


@pytest.fixture(scope="module")
def loaded(tiny_mtp_checkpoint):
    model, mtp = load_model(tiny_mtp_checkpoint.path, dtype=torch.float32, load_mtp=True)
    return model.eval(), mtp.eval()


def hf_hidden(ck, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ck.hf_model.model(ids).last_hidden_state


def test_mtp_matches_independent_recomputation(tiny_mtp_checkpoint, loaded):
    ck, (model, mtp) = tiny_mtp_checkpoint, loaded
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(0))
    h = hf_hidden(ck, ids)
    with torch.no_grad():
        ours_main = model(ids, torch.arange(14))
        assert rel_err(ours_main, h) < TOL  # our h_t is HF's h_t
        pos = torch.arange(13)
        out = mtp(ids[:, 1:], h[:, :-1], pos)
        logits = mtp.compute_logits(out)
    ref_out, ref_logits = reference_mtp(ck, 0, ids[:, 1:], h[:, :-1], pos)
    assert out.shape == (2, 13, 64) and logits.shape == (2, 13, 256)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(logits, ref_logits) < TOL
    # The MTP prediction is not just the main model's: the block changes the answer.
    main_logits = model.compute_logits(ours_main[:, 1:])
    assert rel_err(logits, main_logits) > 0.1


def test_repeated_application_feeds_own_hidden(tiny_mtp_checkpoint, loaded):
    """Step 1 with one MTP layer: the same layer again, fed step 0's output hidden and token
    t+2, at position t+1."""
    ck, (_, mtp) = tiny_mtp_checkpoint, loaded
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    h = hf_hidden(ck, ids)
    with torch.no_grad():
        out0 = mtp(ids[:, 1:-1], h[:, :-2], torch.arange(10), step=0)
        out1 = mtp(ids[:, 2:], out0, torch.arange(1, 11), step=1)
        out5 = mtp(ids[:, 2:], out0, torch.arange(1, 11), step=5)
    ref0, _ = reference_mtp(ck, 0, ids[:, 1:-1], h[:, :-2], torch.arange(10))
    ref1, _ = reference_mtp(ck, 0, ids[:, 2:], ref0, torch.arange(1, 11))
    assert rel_err(out1, ref1) < TOL
    assert torch.equal(out1, out5)
    assert [mtp.layer_for_step(k) for k in range(4)] == [0, 0, 0, 0]


def test_step_beyond_num_layers_uses_last_layer(tiny_mtp_factory):
    ck = tiny_mtp_factory(num_mtp=2)
    model, mtp = load_model(ck.path, dtype=torch.float32, load_mtp=True)
    n_main = ck.config["num_hidden_layers"]
    assert mtp.num_layers == 2
    assert [layer.block.self_attn.layer_id for layer in mtp.layers] == [n_main, n_main + 1]
    assert [mtp.layer_for_step(k) for k in range(5)] == [0, 1, 1, 1, 1]
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    h = hf_hidden(ck, ids)
    pos = torch.arange(9)
    refs = [reference_mtp(ck, i, ids[:, 1:], h[:, :-1], pos)[0] for i in range(2)]
    assert rel_err(refs[0], refs[1]) > 0.1  # the two layers are distinguishable
    with torch.no_grad():
        for step, layer in [(0, 0), (1, 1), (2, 1), (7, 1)]:
            out = mtp(ids[:, 1:], h[:, :-1], pos, step=step)
            assert rel_err(out, refs[layer]) < TOL, f"step {step}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_and_head_are_the_main_models(tiny_mtp_checkpoint, dtype):
    model, mtp = load_model(tiny_mtp_checkpoint.path, dtype=dtype, load_mtp=True)
    mtp_params = dict(mtp.named_parameters())
    assert not any("embed" in n or "head.weight" in n or "lm_head" in n for n in mtp_params)
    assert not any("embed" in n or "lm_head" in n for n in mtp.state_dict())
    main_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not main_ptrs & {p.data_ptr() for p in mtp.parameters()}
    h = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(mtp.compute_logits(h), model.compute_logits(h))
    tok = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = mtp(tok, h, torch.arange(3))
        # Writes to the main model's tensors are seen by the MTP module: shared, not copied.
        model.lm_head.weight[17] += 1.0
        model.model.embed_tokens.weight[6] += 1.0
        after = mtp(tok, h, torch.arange(3))
    assert torch.equal(mtp.compute_logits(h), model.compute_logits(h))
    assert torch.equal(before[0, 0], after[0, 0])  # causal: position 0 reads token 5 only
    assert not torch.equal(before[0, 1], after[0, 1])  # position 1 embeds token 6


def _mtp_batch(pool, req_pool, rows, prefix, chunks, loc):
    seq = [p + len(c) for p, c in zip(prefix, chunks, strict=True)]
    return ForwardBatch.build(
        ForwardMode.DRAFT_EXTEND if max(len(c) for c in chunks) > 1 else ForwardMode.DECODE,
        torch.cat(chunks),
        rows,
        seq,
        [len(c) for c in chunks],
        loc,
        req_pool,
        pool,
        TorchNativeMLABackend(),
    )


def test_mtp_kv_lives_in_layer_num_hidden_layers(tiny_mtp_checkpoint, loaded):
    """Absorbed MTP over the paged pool (draft extend of two ragged rows, then one decode step)
    equals the dense MTP pass, and writes only pool layer L = num_hidden_layers."""
    ck, (_, mtp) = tiny_mtp_checkpoint, loaded
    n_main = ck.config["num_hidden_layers"]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))
    h = hf_hidden(ck, ids)
    with torch.no_grad():
        dense = mtp(ids[:, 1:], h[:, :-1], torch.arange(10))  # [2, 10, d]
    pool = MLATokenToKVPool(64, 1, torch.float32, 32, 8, layer_num=n_main + 1)
    req_pool = ReqToTokenPool(2, 32)
    rows = req_pool.alloc(2)
    loc = torch.randperm(63, generator=torch.Generator().manual_seed(5))[:13] + 1
    req_pool.req_to_token[rows[0], :9] = loc[:9]
    req_pool.req_to_token[rows[1], :4] = loc[9:]
    fb = _mtp_batch(pool, req_pool, rows, [0, 0], [ids[0, 1:10], ids[1, 1:5]], loc)
    with torch.no_grad():
        out = mtp(fb.input_ids, torch.cat([h[0, :9], h[1, :4]]), fb.positions, fb)
    assert rel_err(out[:9], dense[0, :9]) < 1e-5
    assert rel_err(out[9:], dense[1, :4]) < 1e-5
    for layer in range(n_main):
        assert bool((pool.get_key_buffer(layer) == 0).all()), f"main layer {layer} written"
    mtp_buf = pool.get_key_buffer(n_main)
    assert bool((mtp_buf[loc].abs().sum(-1) > 0).all())
    written = torch.zeros(mtp_buf.shape[0], dtype=torch.bool)
    written[loc] = True
    assert bool((mtp_buf[~written] == 0).all())
    # The cached latent is the block's kv_a_layernorm(c_kv) of its input, computed by hand.
    w = {k.split(".", 3)[3]: v for k, v in ck.mtp_tensors.items()}
    x = torch.cat([h[0, :9], h[1, :4]])
    e = ck.hf_model.model.embed_tokens.weight[fb.input_ids]
    x = F.linear(
        torch.cat([rms_norm(e, w["enorm.weight"]), rms_norm(x, w["hnorm.weight"])], -1),
        w["eh_proj.weight"],
    )
    c_kv = F.linear(
        rms_norm(x, w["input_layernorm.weight"]), w["self_attn.kv_a_proj_with_mqa.weight"]
    )
    c_kv = rms_norm(c_kv[:, :32], w["self_attn.kv_a_layernorm.weight"])
    assert rel_err(mtp_buf[loc, 0, :32], c_kv) < 1e-5

    # Decode one more MTP position for row 1 (its 5th) over the cached prefix.
    new_loc = torch.tensor([s for s in range(1, 65) if not written[s]][:1])
    req_pool.req_to_token[rows[1], 4] = new_loc
    fb = _mtp_batch(pool, req_pool, rows[1:], [4], [ids[1, 5:6]], new_loc)
    with torch.no_grad():
        step = mtp(fb.input_ids, h[1, 4:5], fb.positions, fb)
    assert fb.positions.tolist() == [4]
    assert rel_err(step, dense[1, 4:5]) < 1e-5


def test_pool_without_mtp_layer_is_an_error(loaded):
    _, mtp = loaded
    pool = MLATokenToKVPool(8, 1, torch.float32, 32, 8, layer_num=3)  # main layers only
    req_pool = ReqToTokenPool(1, 8)
    rows = req_pool.alloc(1)
    loc = torch.tensor([1, 2])
    req_pool.req_to_token[rows[0], :2] = loc
    fb = _mtp_batch(pool, req_pool, rows, [0], [torch.tensor([3, 4])], loc)
    with pytest.raises(IndexError, match="layer_id 3"), torch.no_grad():
        mtp(fb.input_ids, torch.zeros(2, 64), fb.positions, fb)
