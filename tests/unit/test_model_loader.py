"""srt_ascend.models.loader: names, shards, errors, FP8 dequantisation, the shipped format."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from srt_ascend.distributed import TPGroup
from srt_ascend.models.loader import (
    CheckpointError,
    dequant_block_fp8,
    load_config,
    load_model,
    tp_slice,
)
from srt_ascend.tools import train_tiny

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def checkpoint_names(model, mtp, num_main_layers: int) -> dict[str, torch.Tensor]:
    """Our modules' tensors under DeepSeek-V3's checkpoint names (written out independently of
    the loader and of train_tiny: stacked experts split per expert, MTP `block.` dropped)."""
    out = {}

    def add(name: str, t: torch.Tensor) -> None:
        if name.endswith(".experts.w13"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{name[:-4]}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{name[:-4]}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".experts.w2"):
            for e in range(t.shape[0]):
                out[f"{name[:-3]}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t

    for name, t in model.state_dict().items():
        add(name, t)
    for i, layer in enumerate(mtp.layers if mtp is not None else []):
        for name, t in layer.state_dict().items():
            add(f"model.layers.{num_main_layers + i}.{name.replace('block.', '', 1)}", t)
    return out


def copy_checkpoint(ck, checkpoint_io, dst, edit=None, config_edit=None, num_shards=2) -> str:
    """A copy of MTP checkpoint `ck` at `dst`, tensors passed through `edit(dict)`."""
    tensors = checkpoint_io.read(ck.path)
    if edit is not None:
        edit(tensors)
    config = dict(ck.config)
    if config_edit is not None:
        config_edit(config)
    return checkpoint_io.write(str(dst), config, tensors, num_shards=num_shards)


def test_sharded_checkpoint_with_index_loads_every_tensor(tiny_mtp_checkpoint, checkpoint_io):
    ck = tiny_mtp_checkpoint
    files = sorted(os.listdir(ck.path))
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    model, mtp = load_model(ck.path, dtype=torch.float32, load_mtp=True)
    on_disk = checkpoint_io.read(ck.path)
    loaded = checkpoint_names(model, mtp, ck.config["num_hidden_layers"])
    shared_copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert set(loaded) == set(on_disk) - shared_copies
    for name, t in loaded.items():
        assert torch.equal(t, on_disk[name].float()), name
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0.01  # the random router bias arrived


def test_index_decides_which_files_are_read(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    """A stray shard not listed in the index is not read; without the index it would be."""
    from safetensors.torch import save_file

    path = str(tmp_path / "ckpt")
    shutil.copytree(tiny_mtp_checkpoint.path, path)
    save_file(
        {"model.layers.0.stray.weight": torch.zeros(2)}, os.path.join(path, "old.safetensors")
    )
    load_model(path, dtype=torch.float32, load_mtp=True)
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.stray\.weight"):
        load_model(path, dtype=torch.float32, load_mtp=True)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.norm.weight",
        "model.layers.3.eh_proj.weight",
    ],
)
def test_missing_tensor_is_named(tiny_mtp_checkpoint, checkpoint_io, tmp_path, name):
    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensors.*" + name.replace(".", r"\.")):
        load_model(path, dtype=torch.float32, load_mtp=True)


def test_config_promising_mtp_without_mtp_weights(tiny_hf_factory):
    """transformers writes no MTP layers: asking for them names what is missing."""
    path, _ = tiny_hf_factory()
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.3\."):
        load_model(path, dtype=torch.float32, load_mtp=True)
    model, mtp = load_model(path, dtype=torch.float32, load_mtp=False)
    assert mtp is None and model.config.num_hidden_layers == 3


def test_unexpected_tensor_is_named(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(48)

    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, add)
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.self_attn\.q_norm"):
        load_model(path, dtype=torch.float32, load_mtp=True)


@pytest.mark.parametrize(
    ("name", "bad_shape", "good_shape"),
    [
        ("model.layers.2.self_attn.kv_b_proj.weight", (96, 32), (128, 32)),
        ("model.layers.1.mlp.experts.2.down_proj.weight", (64, 31), (64, 32)),
        ("model.layers.3.eh_proj.weight", (64, 64), (64, 128)),
    ],
)
def test_shape_mismatch_names_tensor_and_both_shapes(
    tiny_mtp_checkpoint, checkpoint_io, tmp_path, name, bad_shape, good_shape
):
    def reshape(t):
        assert tuple(t[name].shape) == good_shape
        t[name] = torch.zeros(bad_shape)

    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, reshape)
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, load_mtp=True)
    msg = str(err.value)
    assert name in msg and str(bad_shape) in msg and str(good_shape) in msg


def quantize_block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block FP8 format: per (block x block) tile, scale = amax / 448;
    weight = fp8(w / scale); `weight_scale_inv` holds scale (what dequantisation multiplies by)."""
    n, k = w.shape
    gn, gk = -(-n // block), -(-k // block)
    scale = torch.empty(gn, gk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale


def dequant_by_loop(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
    return out


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((64, 64), 32),
        ((256, 384), 128),
        ((48, 24), 8),
        ((40, 24), 16),  # partial last tiles
        ((576, 256), 128),  # DeepSeek-V3's kv_a_proj_with_mqa: 512 + 64 rows in 128-blocks
    ],
)
def test_dequant_block_fp8(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    w[: min(block, shape[0]), : min(block, shape[1])] *= 50.0  # tiles of different magnitude
    q, scale = quantize_block_fp8(w, block)
    assert scale.shape == (-(-shape[0] // block), -(-shape[1] // block))
    # e4m3 keeps 3 mantissa bits: within 1/16 of each tile's max (plus subnormals).
    expected = dequant_by_loop(q, scale, block)
    tile_max = dequant_by_loop(torch.ones(shape).to(torch.float8_e4m3fn), scale, block) * FP8_MAX
    assert bool(((expected - w).abs() <= tile_max / 16 + 1e-6).all())
    out = dequant_block_fp8(q, scale, (block, block))
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, expected)


def fp8_checkpoint(ck, checkpoint_io, dst, block, shard_of=None):
    """Copy of `ck` with every attention/MLP/expert projection block-FP8 quantised.
    Returns (path, {name: expected dequantised weight})."""
    tensors = checkpoint_io.read(ck.path)
    expected = {}
    for name in sorted(tensors):
        w = tensors[name]
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and "eh_proj" not in name:
            q, s = quantize_block_fp8(w.float(), block)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            expected[name] = dequant_by_loop(q, s, block)
    config = {
        **ck.config,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        },
    }
    path = checkpoint_io.write(str(dst), config, tensors, num_shards=2, shard_of=shard_of)
    return path, expected


def check_fp8_load(ck, checkpoint_io, path, expected) -> None:
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in expected
    assert "model.layers.3.self_attn.kv_b_proj.weight" in expected
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in expected
    model, mtp = load_model(path, dtype=torch.float32, load_mtp=True)
    loaded = checkpoint_names(model, mtp, 3)
    original = checkpoint_io.read(ck.path)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
        assert not torch.equal(loaded[name], original[name])
    # Tensors that were not quantised load unchanged.
    for name in ["model.norm.weight", "model.layers.3.eh_proj.weight", "lm_head.weight"]:
        assert torch.equal(loaded[name], original[name]), name


def test_fp8_checkpoint_loads_dequantised(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    """Blocks of 8 divide every tiny dimension."""
    path, expected = fp8_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, block=8)
    check_fp8_load(tiny_mtp_checkpoint, checkpoint_io, path, expected)


def test_fp8_checkpoint_with_partial_tiles(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    """Blocks of 16: kv_a_proj_with_mqa has 32 + 8 = 40 rows, so its last row tile is partial
    (the tiny analogue of DeepSeek-V3's 512 + 64 = 576 rows in 128-blocks)."""
    path, expected = fp8_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, block=16)
    check_fp8_load(tiny_mtp_checkpoint, checkpoint_io, path, expected)


def test_fp8_scale_in_another_shard(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    shard_of = lambda name: int(name.endswith("_scale_inv"))
    path, expected = fp8_checkpoint(
        tiny_mtp_checkpoint, checkpoint_io, tmp_path, block=8, shard_of=shard_of
    )
    check_fp8_load(tiny_mtp_checkpoint, checkpoint_io, path, expected)


def test_fp8_weight_without_scale_is_an_error(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"

    def to_fp8(t):
        t[name] = quantize_block_fp8(t[name].float(), 16)[0]

    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, to_fp8)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*scale_inv"):
        load_model(path, dtype=torch.float32, load_mtp=True)


def test_mtp_weights_skipped_when_load_mtp_false(tiny_mtp_checkpoint):
    path = tiny_mtp_checkpoint.path
    main_only, none = load_model(path, dtype=torch.float32, load_mtp=False)
    with_mtp, mtp = load_model(path, dtype=torch.float32, load_mtp=True)
    assert none is None and mtp is not None
    a, b = main_only.state_dict(), with_mtp.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_mtp_on_checkpoint_without_mtp_layers(tiny_mtp_checkpoint, checkpoint_io, tmp_path):
    def no_mtp(config):
        config["num_nextn_predict_layers"] = 0

    def drop(t):
        for name in [n for n in t if n.startswith("model.layers.3.")]:
            del t[name]

    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, drop, no_mtp)
    with pytest.raises(CheckpointError, match="no MTP layers"):
        load_model(path, dtype=torch.float32, load_mtp=True)
    model, mtp = load_model(path, dtype=torch.float32, load_mtp=False)
    assert mtp is None


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", None])
def test_other_model_types_are_rejected(tiny_mtp_checkpoint, checkpoint_io, tmp_path, model_type):
    def retype(config):
        if model_type is None:
            del config["model_type"]
        else:
            config["model_type"] = model_type

    path = copy_checkpoint(tiny_mtp_checkpoint, checkpoint_io, tmp_path, config_edit=retype)
    with pytest.raises(CheckpointError, match=f"model_type {model_type!r}"):
        load_config(path)
    with pytest.raises(CheckpointError, match="not supported"):
        load_model(path, load_mtp=False)


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_train_tiny_checkpoint_round_trip(checkpoint_io, tmp_path, dtype):
    """save_checkpoint's shipped format (bfloat16, float32 router biases, one file) loads back
    into modules identical to the saved ones (after the bfloat16 rounding of saving)."""
    config = checkpoint_io.config(num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model, mtp = train_tiny.build_models(config)
    checkpoint_io.randomize(model, 10)
    checkpoint_io.randomize(mtp, 11)
    out = str(tmp_path)
    train_tiny.save_checkpoint(model, mtp, config, out)
    config.to_json_file(os.path.join(out, "config.json"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "deepseek_v3"
    model2, mtp2 = load_model(out, dtype=dtype, load_mtp=True)
    for ours, theirs in [(model, model2), (mtp, mtp2)]:
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            if k.endswith("e_score_correction_bias"):  # kept in float32 end to end
                assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
                assert a[k].abs().max() > 0.01
            else:
                assert b[k].dtype == dtype, k
                assert torch.equal(b[k], a[k].to(torch.bfloat16).to(dtype)), k
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model2(ids, torch.arange(8))
        draft = mtp2.compute_logits(mtp2(ids[:, 1:], h[:, :-1], torch.arange(7)))
    assert torch.isfinite(draft).all() and draft.shape == (1, 7, 256)


@pytest.mark.parametrize(
    "name, dim",
    [
        ("model.layers.0.self_attn.q_b_proj.weight", 0),
        ("model.layers.0.self_attn.kv_b_proj.weight", 0),
        ("model.layers.0.self_attn.o_proj.weight", 1),
        ("model.layers.0.mlp.up_proj.weight", 0),
        ("model.layers.1.mlp.experts.3.gate_proj.weight", 0),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", 1),
        ("model.layers.4.self_attn.o_proj.weight", 1),  # the MTP block too
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
    ],
)
def test_tp_slices_tile_split_tensors(name, dim):
    t = torch.randn(4, 6)
    parts = [tp_slice(name, t, TPGroup(rank=r, size=2)) for r in (0, 1)]
    assert parts[0].shape[dim] == t.shape[dim] // 2
    assert torch.equal(torch.cat(parts, dim), t)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.1.mlp.gate.weight",  # the router
        "model.layers.4.eh_proj.weight",
        "model.norm.weight",
    ],
)
def test_tp_replicates_the_rest(name):
    t = torch.randn(4, 6)
    assert tp_slice(name, t, TPGroup(rank=1, size=2)) is t
