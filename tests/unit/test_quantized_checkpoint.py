"""Quantized checkpoints written by `srt_ascend.tools.quantize` from the shipped checkpoint:
the on-disk layouts, detection, loader round trips (the int8 / fp8 tensors and scales as on
disk, kept quantized in memory), the MoE paths over quantized experts, and one-line start
errors naming the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from srt_ascend.layers.moe_quant import QuantRoutedExperts
from srt_ascend.layers.quantization import QuantLinear
from srt_ascend.models.loader import CheckpointError, load_config, load_model, shard_files
from srt_ascend.models.quant_config import (
    MODELSLIM_DESCRIPTION,
    QuantConfigError,
    detect_quantization,
    refused_with,
    resolve_quantization,
)
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs
from srt_ascend.tools.quantize import Calibration, quantize_checkpoint

SCHEMES = ("w8a8", "w8a8_dynamic", "fp8_block")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    # every layer quantized (no fallback), unsmoothed: each quantized layer stands for the
    # float checkpoint's own (smoothing: tests/unit/test_quant_calibration.py)
    every_layer = Calibration(sequences=2, smooth_alpha=None, memory_ratio=None)
    return {
        s: quantize_checkpoint(SHIPPED_MODEL, str(root / s), s, True, every_layer) for s in SCHEMES
    }


def _resolve(path, forced=None):
    return resolve_quantization(path, load_config(path), forced, shard_files(path))


def _load(path, **kw):
    config = load_config(path)
    q = resolve_quantization(path, config, kw.pop("forced", None), shard_files(path))
    return load_model(path, torch.float32, load_mtp=True, config=config, quantization=q)


def test_on_disk_layouts(quantized):
    t = load_file(os.path.join(quantized["w8a8"], "model.safetensors"))
    p = "model.layers.1.self_attn.q_a_proj."
    assert t[p + "weight"].dtype == torch.int8 and t[p + "weight"].shape == (128, 256)
    assert t[p + "weight_scale"].shape == (128, 1) and t[p + "weight_offset"].shape == (128, 1)
    assert t[p + "input_scale"].shape == (1,) and t[p + "input_offset"].dtype == torch.int8
    assert t[p + "quant_bias"].dtype == torch.int32 and t[p + "deq_scale"].dtype == torch.float32
    e = "model.layers.4.mlp.experts.3.down_proj."  # the MTP layer's (--quant-mtp): dynamic
    assert t[e + "weight"].dtype == torch.int8 and e + "input_scale" not in t
    with open(os.path.join(quantized["w8a8"], MODELSLIM_DESCRIPTION)) as f:
        desc = json.load(f)
    assert desc["model_quant_type"] == "W8A8" and desc[p + "weight"] == "W8A8"
    assert desc[e + "weight"] == "W8A8_DYNAMIC" and desc["lm_head.weight"] == "FLOAT"
    assert desc["model.layers.1.self_attn.kv_b_proj.weight"] == "FLOAT"
    assert set(desc) - {"model_quant_type"} == set(t)
    f = load_file(os.path.join(quantized["fp8_block"], "model.safetensors"))
    w = "model.layers.2.self_attn.kv_b_proj."
    assert f[w + "weight"].dtype == torch.float8_e4m3fn and f[w + "weight"].shape == (512, 64)
    assert f[w + "weight_scale_inv"].shape == (4, 1)  # ceil(512/128), ceil(64/128)
    with open(os.path.join(quantized["fp8_block"], "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    assert qc == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }


def test_detection(quantized):
    for scheme, fmt in (("w8a8", "modelslim"), ("w8a8_dynamic", "modelslim"), ("fp8_block", "fp8")):
        path = quantized[scheme]
        assert detect_quantization(path, load_config(path)) == fmt
    assert detect_quantization(SHIPPED_MODEL, load_config(SHIPPED_MODEL)) is None
    with pytest.raises(QuantConfigError, match="--quantization fp8: .* is a modelslim checkpoint"):
        _resolve(quantized["w8a8"], "fp8")
    with pytest.raises(QuantConfigError, match="not a quantized checkpoint"):
        _resolve(SHIPPED_MODEL, "modelslim")
    with pytest.raises(ValueError, match="--quantization 'awq' is not served"):
        ServerArgs(quantization="awq")
    q = _resolve(quantized["fp8_block"], "fp8")
    assert "--tp-size" in refused_with(q, ServerArgs(tp_size=2))
    assert refused_with(q, ServerArgs()) is None
    deterministic = ServerArgs(enable_deterministic_inference=True)
    assert "FP8_BLOCK layers have no batch-invariant" in refused_with(q, deterministic)
    for scheme in ("w8a8", "w8a8_dynamic"):  # int8 layers serve the mode
        assert refused_with(_resolve(quantized[scheme]), deterministic) is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip(quantized, scheme):
    """Every quantized tensor in memory equals the file's (int8 / fp8 bit for bit; scales
    cast to float32 exactly)."""
    path = quantized[scheme]
    disk = load_file(os.path.join(path, "model.safetensors"))
    model, mtp = _load(path)
    seen = 0
    for root, layer_of in ((model, lambda p: p), (mtp, _mtp_name)):
        for name, module in root.named_modules():
            if isinstance(module, QuantLinear):
                for leaf, t in module.named_parameters(recurse=False):
                    _same(t, disk[f"{layer_of(name)}.{leaf}"])
                    seen += 1
            elif isinstance(module, QuantRoutedExperts):
                for leaf, t in module.named_parameters(recurse=False):
                    stack, _, sub = leaf.partition("_")
                    sub = sub or "weight"
                    for e in range(t.shape[0]):
                        base = f"{layer_of(name)}.{e}."
                        if stack == "w13":
                            pair = (disk[f"{base}gate_proj.{sub}"], disk[f"{base}up_proj.{sub}"])
                            _same(t[e], torch.cat(pair))
                        else:
                            _same(t[e], disk[f"{base}down_proj.{sub}"])
                    seen += 1
    assert seen > 40  # projections' tensors and expert stacks, main and MTP layers
    # kv_b_proj is float in memory (the absorbed attention reads it so)
    assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(mtp.layers[0].block.mlp.experts, QuantRoutedExperts)


def _mtp_name(path: str) -> str:
    _, i, rest = path.split(".", 2)
    return f"model.layers.{4 + int(i)}.{rest.removeprefix('block.')}"


def _same(mem: torch.Tensor, disk: torch.Tensor) -> None:
    """Bit for bit in the file's dtype; or float32 holding the file's values (scales)."""
    if mem.dtype == disk.dtype:
        assert torch.equal(mem.view(torch.uint8), disk.view(torch.uint8))
    else:
        assert mem.dtype == torch.float32 and disk.dtype != torch.float8_e4m3fn
        assert torch.equal(mem, disk.float())
    if disk.dtype == torch.int8 and disk.dim() >= 2:  # weights stay int8 / fp8 in memory
        assert mem.dtype == torch.int8


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.no_grad()
def test_moe_paths_agree_on_quantized_experts(quantized, scheme):
    model, _ = _load(quantized[scheme])
    experts = model.model.layers[2].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    outs = {p: getattr(experts, f"forward_{p}")(x, w, ids) for p in ("sparse", "dense", "gathered")}
    torch.testing.assert_close(outs["dense"], outs["sparse"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["gathered"], outs["sparse"], rtol=1e-5, atol=1e-5)
    ref, _ = load_model(SHIPPED_MODEL, torch.float32, load_mtp=False)
    want = ref.model.layers[2].mlp.experts.forward_sparse(x, w, ids)
    assert float((outs["sparse"] - want).abs().max()) < 0.05 * float(want.abs().max())


def _copy(src: str, dst: str, edit_tensors=None, edit_description=None) -> str:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        path = os.path.join(dst, "model.safetensors")
        with safe_open(path, framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        edit_tensors(t)
        save_file(t, path)
    if edit_description is not None:
        path = os.path.join(dst, MODELSLIM_DESCRIPTION)
        with open(path) as f:
            d = json.load(f)
        edit_description(d)
        with open(path, "w") as f:
            json.dump(d, f)
    return dst


def test_unknown_scheme_names_the_tensor(quantized, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    path = _copy(
        quantized["w8a8"], str(tmp_path / "c"), edit_description=lambda d: d.update({name: "W4A16"})
    )
    with pytest.raises(QuantConfigError, match=f"{name}: scheme 'W4A16' is not served"):
        _load(path)


def test_missing_scale_names_the_tensor(quantized, tmp_path):
    name = "model.layers.0.mlp.down_proj.deq_scale"
    path = _copy(quantized["w8a8"], str(tmp_path / "c"), edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensors in checkpoint: {name}"):
        _load(path)


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("w8a8_dynamic", "model.layers.2.mlp.experts.5.up_proj.weight_scale"),
        ("fp8_block", "model.layers.1.self_attn.q_b_proj.weight_scale_inv"),
    ],
)
def test_shape_mismatch_names_the_tensor(quantized, tmp_path, scheme, name):
    def cut(t):
        t[name] = t[name][:-1].contiguous()

    path = _copy(quantized[scheme], str(tmp_path / "c"), edit_tensors=cut)
    with pytest.raises(CheckpointError, match=f"shape mismatch for {name}"):
        _load(path)


def test_float_layer_given_int8_weight_is_an_error(quantized, tmp_path):
    name = "model.layers.3.self_attn.o_proj.weight"
    path = _copy(
        quantized["w8a8_dynamic"],
        str(tmp_path / "c"),
        edit_description=lambda d: d.update({name: "FLOAT"}),
    )
    with pytest.raises(CheckpointError, match=f"dtype mismatch for {name}"):
        _load(path)


@torch.no_grad()
def test_modelslim_norm_bias_is_added(quantized, tmp_path):
    """An anti-outlier `*norm.bias` in a ModelSlim checkpoint: that RMSNorm adds it."""
    name = "model.layers.1.input_layernorm.bias"
    bias = torch.randn(256, generator=torch.Generator().manual_seed(0)).bfloat16()
    path = _copy(
        quantized["w8a8_dynamic"],
        str(tmp_path / "c"),
        edit_tensors=lambda t: t.update({name: bias}),
        edit_description=lambda d: d.update({name: "FLOAT"}),
    )
    model, _ = _load(path)
    norm = model.model.layers[1].input_layernorm
    assert torch.equal(norm.bias, bias.float())
    assert model.model.layers[2].input_layernorm.bias is None
    x = torch.randn(3, 256)
    plain = norm.weight * torch.nn.functional.rms_norm(x, (256,), eps=norm.eps)
    torch.testing.assert_close(norm(x), plain + bias.float())


@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "fp8_block"])
@torch.no_grad()
def test_sharded_source_quantized_shard_by_shard(tiny_mtp_checkpoint, tmp_path, scheme):
    """A sharded checkpoint (two shards + index, random weights) is written shard by shard
    with its index; the quantized model's logits follow the float model's."""
    src = tiny_mtp_checkpoint.path
    every_layer = Calibration(memory_ratio=None)
    dst = quantize_checkpoint(src, str(tmp_path / scheme), scheme, True, every_layer)
    shards = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert shards == sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for shard in shards:
        with safe_open(os.path.join(dst, shard), framework="pt") as f:
            assert all(weight_map[k] == shard for k in f.keys())
    if scheme == "fp8_block":  # moe_intermediate_size 32: 128-row blocks straddle gate / up
        with pytest.raises(CheckpointError, match=r"mlp\.experts: FP8 blocks of 128 rows"):
            _load(dst)
        return
    model, mtp = _load(dst)
    assert isinstance(mtp.layers[0].block.mlp.experts, QuantRoutedExperts)
    ref, _ = load_model(src, torch.float32, load_mtp=False)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    got = model.compute_logits(model(ids, torch.arange(12)))
    want = ref.compute_logits(ref(ids, torch.arange(12)))
    assert float((got - want).abs().max()) < 0.1 * float(want.abs().max())


def _free_addr() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _tp_rank(local_rank: int, addr: str, path: str, out: str, ep: bool = False) -> None:
    """One of 2 gloo ranks (`ep`: experts partitioned over them): its shard of the
    W8A8_DYNAMIC model, a dense forward's logits and the per-channel tensors it holds, saved
    for the parent to check."""
    from srt_ascend.distributed import DistInit, init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(DistInit(addr, 2), local_rank, "gloo", ep)
    try:
        config = load_config(path)
        q = resolve_quantization(path, config, None, shard_files(path))
        model, _ = load_model(
            path, torch.float32, load_mtp=True, config=config, tp=tp, quantization=q
        )
        with torch.no_grad():
            ids = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 3]])
            logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])))
        layer = model.model.layers[1]
        held = {
            "logits": logits,
            "q_b_scale": layer.self_attn.q_b_proj.weight_scale.data,
            "o_weight": layer.self_attn.o_proj.weight.data,
            "o_scale": layer.self_attn.o_proj.weight_scale.data,
            "w13_scale": layer.mlp.experts.w13_weight_scale.data,
            "w2": layer.mlp.experts.w2.data,
            "w2_scale": layer.mlp.experts.w2_weight_scale.data,
        }
        torch.save(held, f"{out}.{tp.rank}")
    finally:
        tp.destroy()


def test_tensor_parallel_w8a8_dynamic(quantized, tmp_path):
    """--tp-size 2 over gloo: each rank holds its slice of the int8 weights, column-parallel
    layers their rows' scales, row-parallel ones every scale; the logits follow TP = 1's
    within the row-parallel layers' per-slice activation scales; with --ep-size 2 too. W8A8
    static and FP8 refuse TP with a one-line error naming the scheme."""
    import torch.multiprocessing as mp

    path = quantized["w8a8_dynamic"]
    out = str(tmp_path / "rank")
    mp.start_processes(_tp_rank, args=(_free_addr(), path, out), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    model, _ = _load(path)
    layer = model.model.layers[1]
    attn, experts = layer.self_attn, layer.mlp.experts
    for r, held in enumerate(ranks):
        assert torch.equal(held["q_b_scale"], attn.q_b_proj.weight_scale.chunk(2, 0)[r])
        assert torch.equal(held["o_weight"], attn.o_proj.weight.chunk(2, 1)[r])
        assert torch.equal(held["o_scale"], attn.o_proj.weight_scale)
        assert torch.equal(
            held["w13_scale"],
            torch.cat([part.chunk(2, 1)[r] for part in experts.w13_weight_scale.chunk(2, 1)], 1),
        )
        assert torch.equal(held["w2"], experts.w2.chunk(2, 2)[r])
    torch.testing.assert_close(ranks[0]["logits"], ranks[1]["logits"])
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 3]])
        want = model.compute_logits(model(ids, torch.arange(ids.shape[1])))
    got = ranks[0]["logits"]
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    # --ep-size 2: each rank holds its routed experts whole, their scales and offsets with them
    # (the other rank's skipped at load)
    out = str(tmp_path / "ep_rank")
    mp.start_processes(
        _tp_rank, args=(_free_addr(), path, out, True), nprocs=2, start_method="spawn"
    )
    for r in range(2):
        held = torch.load(f"{out}.{r}")
        assert torch.equal(held["w2"], experts.w2.chunk(2, 0)[r])
        assert torch.equal(held["w2_scale"], experts.w2_weight_scale.chunk(2, 0)[r])
        assert float((held["logits"].argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    tp2 = ServerArgs(tp_size=2)
    assert refused_with(_resolve(path), tp2) is None
    assert "for W8A8 layers (its quant_bias" in refused_with(_resolve(quantized["w8a8"]), tp2)
    assert "for FP8_BLOCK layers" in refused_with(_resolve(quantized["fp8_block"]), tp2)
    compiled = ServerArgs(enable_torch_compile=True)
    assert "(modelslim) with --enable-torch-compile" in refused_with(_resolve(path), compiled)
