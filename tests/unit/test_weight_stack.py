"""Run-time weight stacks (q_a + kv_a projections, gate + up, the shared expert as an extra
routed row): same outputs and the same parameters as the plain layout, in-place updates write
through, and a parameter given new storage sends its module back to the plain path."""

from __future__ import annotations

import pytest
import torch

import srt_ascend.models.loader as loader
from srt_ascend.layers.moe import DeepseekMoE, DenseMLP
from srt_ascend.models.deepseek_v3 import MLAAttention


@pytest.fixture(autouse=True)
def default_gemms(gemm_mode):
    """PyTorch's own matmuls, batch-invariant mode off: the paths compared here are the plain
    ones (an Engine started earlier in the process with --enable-deterministic-inference
    leaves the process-wide mode on after its shutdown)."""
    gemm_mode(None, None)


@pytest.fixture(scope="module")
def pair(tiny_mtp_factory):
    """The same float32 checkpoint loaded stacked (the default) and plain."""
    path = tiny_mtp_factory().path
    stacked = loader.load_model(path, dtype=torch.float32)
    fuse = loader.fuse_weights
    loader.fuse_weights = lambda m: None
    try:
        plain = loader.load_model(path, dtype=torch.float32)
    finally:
        loader.fuse_weights = fuse
    return stacked, plain


def stacks_of(model) -> list:
    out = []
    for m in model.modules():
        if isinstance(m, MLAAttention):
            out.append(m.qkv_a)
        elif isinstance(m, DeepseekMoE):
            out.extend(m.stacks or ())
        elif isinstance(m, DenseMLP):
            out.append(m.gate_up)
    return [s for s in out if s is not None]


def test_every_layer_is_stacked(pair):
    (model, mtp), (plain, plain_mtp) = pair
    cfg = model.config
    attn = cfg.num_hidden_layers + 1  # + the MTP layer
    moe_layers = attn - cfg.first_k_dense_replace
    # q_a + kv_a per attention; per MoE layer the expert stacks w13 and w2 and the shared
    # MLP's gate + up (row E of w13); gate + up per dense MLP
    expected = attn + 3 * moe_layers + cfg.first_k_dense_replace
    assert len(stacks_of(model) + stacks_of(mtp)) == expected
    assert all(s.intact() for s in stacks_of(model) + stacks_of(mtp))
    assert not stacks_of(plain) and not stacks_of(plain_mtp)


def test_same_parameters(pair):
    (model, mtp), (plain, plain_mtp) = pair
    for a, b in ((model, plain), (mtp, plain_mtp)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


def run(model, mtp, ids):
    with torch.no_grad():
        h = model(ids, torch.arange(ids.shape[1]))
        m = mtp(ids, h, torch.arange(ids.shape[1]))
        return model.compute_logits(h), mtp.compute_logits(m)


@pytest.mark.parametrize("shape", [(2, 24), (1, 2)])  # sparse and dense expert paths
def test_same_outputs(pair, shape):
    (model, mtp), (plain, plain_mtp) = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=gen)
    for a, b in zip(run(model, mtp, ids), run(plain, plain_mtp, ids)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 6])
def test_static_shape_paths_match_the_plain_layout(pair, tokens):
    """Graph-captured MoE (gathered while T * (k + shared) < E + 1 rows, else dense) over the
    stacked weights equals the plain layer's eager output."""
    (model, _), (plain, _) = pair
    h = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    cfg, moe = model.config, model.model.layers[-1].mlp
    rows = moe.stacks[0].tensor.shape[0]
    path = moe.experts.choose_path(tokens, cfg.num_experts_per_tok + 1, rows, True)
    assert path == ("gathered" if tokens * (cfg.num_experts_per_tok + 1) < rows else "dense")
    with torch.no_grad():
        for layer, ref in zip(model.model.layers, plain.model.layers):
            if isinstance(layer.mlp, DeepseekMoE):
                out, want = layer.mlp(h, static_shapes=True), ref.mlp(h)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh(tiny_mtp_factory):
    return loader.load_model(tiny_mtp_factory().path, dtype=torch.float32)


def test_in_place_update_writes_through(fresh):
    model, _ = fresh
    layer = model.model.layers[1]
    shared = layer.mlp.shared_experts.down_proj.weight
    kv_a = layer.self_attn.kv_a_proj_with_mqa.weight
    with torch.no_grad():
        shared.mul_(2.0)
        kv_a.add_(0.5)
    w13, w2 = layer.mlp.stacks
    assert w2.intact() and layer.self_attn.qkv_a.intact()
    assert torch.equal(w2.tensor[-1], shared)
    assert torch.equal(layer.self_attn.qkv_a.tensor[-kv_a.shape[0] :], kv_a)


def test_new_storage_falls_back_to_the_plain_path(fresh):
    model, mtp = fresh
    ids = torch.randint(
        0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2)
    )
    before = run(model, mtp, ids)
    layer = model.model.layers[1]
    for p in (layer.mlp.shared_experts.up_proj.weight, layer.self_attn.q_a_proj.weight):
        p.data = p.data.clone()  # what a dtype or device move does
        with torch.no_grad():
            p.mul_(1.5)
    assert not layer.mlp.stacks[0].intact() and not layer.self_attn.qkv_a.intact()
    after = run(model, mtp, ids)
    assert not torch.allclose(before[0], after[0])  # the new values are the ones used
    layer.mlp.stacks, layer.self_attn.qkv_a = None, None  # the plain path, explicitly
    torch.testing.assert_close(run(model, mtp, ids)[0], after[0], rtol=0, atol=0)
