"""SmoothQuant for W8A8 static: move activation outliers into the weights before quantizing.

A per-tensor static activation scale is set by the input's largest channels; a few outlier
channels make every other channel's integer steps coarse. SmoothQuant (Xiao et al., 2023)
divides input channel j by s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) and multiplies
the weight columns by s_j, y = (x / s)(W s)^T = x W^T: the activation's channels even out,
the weight's absorb the range. Here the division is folded into what produces x, so the
checkpoint keeps ModelSlim's exact format (no extra tensor):

- an RMSNorm's output: its weight / s (every consumer of that norm gets W * s: the attention's
  q_a / kv_a projections; the MLP's gate / up, or the MoE's shared and routed experts' gate /
  up and its router gate);
- q_b_proj's input: q_a_layernorm's weight / s;
- o_proj's input (the attention's value mix): kv_b_proj's value rows / s;
- down_proj's input (silu(gate) * up): up_proj's rows / s.

Factors are rounded to powers of two, so every fold is exact in any float format: the
smoothed float checkpoint computes bit for bit the function of the original (a float32 run
checks it in tests/unit/test_quant_calibration.py). Groups are smoothed only where one of
their consumers is quantized W8A8 static.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DEFAULT_ALPHA = 0.5


@dataclass(frozen=True)
class SmoothGroup:
    """One place to fold factors: the input channels of `consumers` (checkpoint layer names)
    are produced by `source` (a tensor name): element j of a norm weight, or row
    `rows[j]` of a linear's weight (rows None: row j). `act`: the consumer whose inputs give
    the channel maxima; `fixed`: consumers scaled but not counted in the weight maxima (the
    router gate stays float)."""

    source: str
    consumers: tuple[str, ...]
    act: str
    fixed: tuple[str, ...] = ()
    rows: tuple[int, ...] | None = None


def smoothing_groups(names: set[str], config: dict, static: set[str]) -> list[SmoothGroup]:
    """The groups of a DeepSeek-V3 checkpoint (tensor `names`) with a consumer in `static`
    (layer names quantized W8A8 static)."""
    total = config["num_hidden_layers"] + int(config.get("num_nextn_predict_layers") or 0)
    groups = []
    for i in range(total):
        p = f"model.layers.{i}"
        for g in _layer_groups(p, names, config):
            if any(c in static for c in g.consumers):
                groups.append(g)
    return groups


def _layer_groups(p: str, names: set[str], config: dict) -> list[SmoothGroup]:
    has = lambda layer: f"{layer}.weight" in names  # noqa: E731
    a, m = f"{p}.self_attn", f"{p}.mlp"
    out = []
    q = f"{a}.q_a_proj" if has(f"{a}.q_a_proj") else f"{a}.q_proj"
    kv_a = f"{a}.kv_a_proj_with_mqa"
    if has(kv_a):
        out.append(SmoothGroup(f"{p}.input_layernorm.weight", (q, kv_a), kv_a))
    if has(f"{a}.q_b_proj"):
        out.append(SmoothGroup(f"{a}.q_a_layernorm.weight", (f"{a}.q_b_proj",), f"{a}.q_b_proj"))
    if has(f"{a}.kv_b_proj") and has(f"{a}.o_proj"):
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        heads = config["num_attention_heads"]
        rows = tuple(h * (nope + v) + nope + d for h in range(heads) for d in range(v))
        out.append(SmoothGroup(f"{a}.kv_b_proj.weight", (f"{a}.o_proj",), f"{a}.o_proj", (), rows))
    norm = f"{p}.post_attention_layernorm.weight"
    for mlp in (m, f"{m}.shared_experts"):
        if has(f"{mlp}.up_proj"):
            up, down = f"{mlp}.up_proj", f"{mlp}.down_proj"
            out.append(SmoothGroup(f"{up}.weight", (down,), down))
    if has(f"{m}.up_proj"):
        out.append(SmoothGroup(norm, (f"{m}.gate_proj", f"{m}.up_proj"), f"{m}.up_proj"))
    elif has(f"{m}.shared_experts.up_proj"):
        experts = sorted(
            n[: -len(".weight")]
            for n in names
            if n.startswith(f"{m}.experts.") and n.endswith(("gate_proj.weight", "up_proj.weight"))
        )
        shared = (f"{m}.shared_experts.gate_proj", f"{m}.shared_experts.up_proj")
        out.append(SmoothGroup(norm, (*shared, *experts), shared[1], (f"{m}.gate",)))
    return out


def smoothing_factors(
    channel_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """s [K]: max|x_j|^alpha / max_n |W[n, j]|^(1 - alpha) over the consumers' weights,
    rounded to the nearest power of two (exact folds) and kept within 2^-16 .. 2^16."""
    w_max = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)
    x_max = channel_max.float().clamp(min=1e-5)
    s = x_max.pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return torch.exp2(torch.log2(s).round().clamp(-16, 16))


def smoothed_tensors(
    tensors: dict[str, torch.Tensor],
    groups: list[SmoothGroup],
    channel_max: dict[str, torch.Tensor],
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, torch.Tensor]:
    """The tensors the groups change, in their own dtypes: {name: new tensor}. `tensors`
    holds (at least) every source and consumer weight; `channel_max` the `act` layers'
    per-channel input maxima. A group reads the tensors as earlier groups left them."""
    out: dict[str, torch.Tensor] = {}
    get = lambda n: out.get(n, tensors[n])  # noqa: E731
    for g in groups:
        s = smoothing_factors(channel_max[g.act], [get(f"{c}.weight") for c in g.consumers], alpha)
        src = get(g.source)
        rows = torch.arange(s.numel()) if g.rows is None else torch.tensor(g.rows)
        new = src.float().clone()
        new[rows] = new[rows] / (s if src.dim() == 1 else s[:, None])
        out[g.source] = new.to(src.dtype)
        for c in (*g.consumers, *g.fixed):
            w = get(f"{c}.weight")
            out[f"{c}.weight"] = (w.float() * s).to(w.dtype)
    return out


def write_smoothed(src: str, dst: str, changed: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint `src` in `dst` with the `changed` tensors replaced (same shards,
    same other files); returns dst."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".safetensors"):
            shutil.copyfile(path, os.path.join(dst, name))
            continue
        with safe_open(path, framework="pt") as f:
            out = {k: changed.get(k, f.get_tensor(k)).contiguous() for k in f.keys()}
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


def read_tensors(src: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The `names` tensors of checkpoint `src` (any shard)."""
    out = {}
    for shard in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys() if k in names)
    return out


def smooth_checkpoint(
    src: str, dst: str, static: set[str], sequences: int, alpha: float = DEFAULT_ALPHA
) -> str:
    """Writes `src` smoothed for the `static` layers (module docstring) to `dst`; the channel
    maxima come from `sequences` calibration windows. Returns dst (src itself when no group
    has a static consumer)."""
    from srt_ascend.tools.calibration import input_stats

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    names = set()
    for shard in (n for n in os.listdir(src) if n.endswith(".safetensors")):
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            names.update(f.keys())
    groups = smoothing_groups(names, config, static)
    if not groups:
        return src
    stats = input_stats(src, {g.act for g in groups}, sequences)
    wanted = {g.source for g in groups}
    wanted |= {f"{c}.weight" for g in groups for c in (*g.consumers, *g.fixed)}
    changed = smoothed_tensors(
        read_tensors(src, wanted), groups, {k: v.channel_max for k, v in stats.items()}, alpha
    )
    return write_smoothed(src, dst, changed)
