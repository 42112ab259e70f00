"""The quantizer's calibrated steps: SmoothQuant's folds leave the float model's function
unchanged bit for bit (power-of-two factors), and the sensitivity fallback keeps the most
sensitive layers float within the memory budget, which the loaded model's own byte count
(what the server reports) confirms."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from srt_ascend.layers.quantization import QuantLinear
from srt_ascend.models.loader import load_config, load_model, shard_files
from srt_ascend.models.quant_config import MODELSLIM_DESCRIPTION, resolve_quantization
from srt_ascend.models.weight_memory import weight_memory
from srt_ascend.server_args import SHIPPED_MODEL
from srt_ascend.tools.quant_sensitivity import choose_float, quantized_bytes
from srt_ascend.tools.quantize import Calibration, quantize_checkpoint
from srt_ascend.tools.smooth_quant import (
    read_tensors,
    smoothed_tensors,
    smoothing_factors,
    smoothing_groups,
    write_smoothed,
)


def _names_and_config(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    with open(os.path.join(path, "config.json")) as f:
        return names, json.load(f)


def test_smoothing_factors_are_powers_of_two():
    x_max = torch.tensor([0.01, 1.0, 40.0, 3000.0])
    w = torch.tensor([[0.5, 0.1, 0.02, 0.001]])
    s = smoothing_factors(x_max, [w], alpha=0.5)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # exact folds
    assert s[3] > s[2] > s[1] > s[0]  # the outlier channels are divided most


@torch.no_grad()
def test_smoothing_preserves_the_float_function_exactly(tmp_path):
    """Every group of the shipped checkpoint (main layers and the MTP layer) folded with
    factors from synthetic channel maxima spread over 2^-6 .. 2^6: float32 logits of the main
    model and the MTP layer are bit-identical to the unsmoothed checkpoint's."""
    names, config = _names_and_config(SHIPPED_MODEL)
    static = {n[: -len(".weight")] for n in names if n.endswith("_proj.weight")}
    groups = smoothing_groups(names, config, static)
    sources = {g.source for g in groups}
    assert {"model.layers.0.input_layernorm.weight", "model.layers.4.mlp.up_proj.weight"} & sources
    assert any(g.rows is not None for g in groups)  # kv_b_proj's value rows -> o_proj
    gen = torch.Generator().manual_seed(0)
    maxima = {}
    for g in groups:
        k = read_tensors(SHIPPED_MODEL, {f"{g.consumers[0]}.weight"})
        width = next(iter(k.values())).shape[1]
        maxima[g.act] = torch.exp2(torch.randint(-6, 7, (width,), generator=gen).float())
    wanted = {g.source for g in groups} | {
        f"{c}.weight" for g in groups for c in (*g.consumers, *g.fixed)
    }
    changed = smoothed_tensors(read_tensors(SHIPPED_MODEL, wanted), groups, maxima)
    original = read_tensors(SHIPPED_MODEL, set(changed))
    assert sum(not torch.equal(changed[n], original[n]) for n in changed) > 20  # really folded
    dst = write_smoothed(SHIPPED_MODEL, str(tmp_path / "smoothed"), changed)
    (a, a_mtp), (b, b_mtp) = (load_model(p, torch.float32) for p in (SHIPPED_MODEL, dst))
    ids = torch.randint(0, 8192, (2, 24), generator=gen)
    pos = torch.arange(24)
    ha, hb = a(ids, pos), b(ids, pos)
    assert torch.equal(a.compute_logits(ha), b.compute_logits(hb))
    assert torch.equal(a_mtp(ids, ha, pos), b_mtp(ids, hb, pos))


def test_fallback_respects_the_memory_ratio():
    """Greedy by score; a layer that does not fit is skipped and smaller ones still tried;
    the main model's and the MTP layers' budgets are separate."""
    plan = {f"model.layers.{i}.l{j}": "W8A8_DYNAMIC" for i in (0, 1, 2) for j in range(4)}
    shapes = {n: (256, 256) for n in plan}
    shapes["model.layers.0.l0"] = (1024, 256)  # most sensitive but too big to fit
    scores = {n: float(i) for i, n in enumerate(sorted(plan, reverse=True))}
    chosen = choose_float(plan, shapes, scores, 0.6, num_layers=2)
    assert "model.layers.0.l0" not in chosen and chosen
    for part in (lambda n: n < 2, lambda n: n >= 2):
        scope = [n for n in plan if part(int(n.split(".")[2]))]
        held = sum(
            2 * shapes[n][0] * shapes[n][1] if n in chosen else quantized_bytes(plan[n], *shapes[n])
            for n in scope
        )
        assert held <= 0.6 * sum(2 * shapes[n][0] * shapes[n][1] for n in scope)
    # the next most sensitive layer that fits was taken
    fits = [n for n in sorted(scores, key=lambda n: -scores[n]) if n != "model.layers.0.l0"]
    assert fits[0] in chosen
    assert choose_float(plan, shapes, scores, 0.5, num_layers=2) == []  # no room


@pytest.mark.parametrize("load_mtp", [False, True], ids=["main", "with-mtp"])
def test_fallback_checkpoint_within_budget_in_memory(tmp_path_factory, load_mtp):
    """W8A8_DYNAMIC with the fallback (one sensitivity window): some layers are FLOAT in the
    description and load as float layers; the loaded model's quantized scope takes at most
    0.55x its bf16 bytes, with or without the MTP layer."""
    root = tmp_path_factory.getbasetemp() / "fallback_w8a8_dynamic"
    if not (root / MODELSLIM_DESCRIPTION).exists():
        quick = Calibration(sequences=1, sensitivity_sequences=1)
        quantize_checkpoint(SHIPPED_MODEL, str(root), "w8a8_dynamic", True, quick)
    with open(root / MODELSLIM_DESCRIPTION) as f:
        description = json.load(f)
    kept = [n for n, s in description.items() if s == "FLOAT" and n.endswith("_proj.weight")]
    kept = [n for n in kept if "kv_b_proj" not in n and "eh_proj" not in n]
    assert kept, "the fallback kept no layer float"
    path = str(root)
    config = load_config(path)
    q = resolve_quantization(path, config, None, shard_files(path))
    model, mtp = load_model(path, torch.bfloat16, load_mtp=load_mtp, config=config, quantization=q)
    main = [n for n in kept if int(n.split(".")[2]) < config.num_hidden_layers]
    module = model.get_submodule(main[0][: -len(".weight")])
    assert not isinstance(module, QuantLinear) and module.weight.dtype == torch.bfloat16
    mem = weight_memory([model, mtp])
    assert 0.5 < mem["quantized_weight_bytes"] / mem["quantized_weight_bytes_as_bf16"] <= 0.55
