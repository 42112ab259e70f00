"""Write a quantized copy of a float DeepSeek-V3 checkpoint in the layouts deployments use.

    python -m srt_ascend.tools.quantize --scheme {w8a8,w8a8_dynamic,fp8_block} SRC DST
        [--quant-mtp] [--calib-sequences N] [--smooth-alpha A | --no-smooth]
        [--memory-ratio R | --no-fallback]

Quantized: every attention projection (q_a / q_b / q, kv_a_proj_with_mqa, o_proj), dense
MLP, shared and routed expert of the main layers, and of the MTP layer's block with
`--quant-mtp` (its eh_proj, norms and the router gates stay float, as do the embedding and LM
head). The other tensors are copied as they are.

- `w8a8` (msModelSlim W8A8, as its DeepSeek checkpoints mix it): linear layers static W8A8,
  routed experts W8A8_DYNAMIC. Per layer: int8 `weight` [N, K] with per-channel symmetric
  `weight_scale` / `weight_offset` (0) [N, 1]; the input's per-tensor asymmetric
  `input_scale` / `input_offset` [1] calibrated on `--calib-sequences` windows of the
  training corpus the tiny model was trained on (srt_ascend.tools.corpus, held-out files
  excluded), over the range of each window's `--calib-clip` quantiles (0.9999: outliers
  saturate); `deq_scale` = input_scale * weight_scale float32 [N]; `quant_bias` int32 [N] =
  -input_offset * sum_k weight (the offset folded into the integer sum).
- `w8a8_dynamic`: every quantized layer W8A8_DYNAMIC (int8 weight, weight_scale /
  weight_offset [N, 1]; activations are quantised per token at run time).
- Both write `quant_model_description.json`: "model_quant_type", and every tensor's scheme
  (its scales under the same scheme; everything else `FLOAT`). MLA's kv_b_proj stays FLOAT.
- `fp8_block` (DeepSeek-V3's release format): `weight` float8_e4m3fn and `weight_scale_inv`
  float32 [ceil(N/128), ceil(K/128)] (the factor each 128 x 128 block dequantises by;
  scale = block max / 448), kv_b_proj included; config.json gains `quantization_config`
  {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]}.

Two calibrated steps keep the quantized model close to the float one, in the formats' own
terms (no tensor a loader would not know):
- W8A8 static layers are smoothed first (SmoothQuant, `--smooth-alpha` 0.5: per input channel
  power-of-two factors folded into the RMSNorm weight or the previous linear,
  srt_ascend.tools.smooth_quant), then their activation ranges are calibrated;
- every scheme: the layers whose quantisation moves the next-token distributions most stay
  `FLOAT` (ModelSlim's fallback; FP8: no `weight_scale_inv`) while the quantized scope's bytes
  stay within `--memory-ratio` (0.55) of bf16's (srt_ascend.tools.quant_sensitivity).

Scales and offsets are stored in the checkpoint's dtype (bf16 for the shipped one), as
ModelSlim does; weights are quantised with the stored (rounded) scales.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from srt_ascend.layers.ops.quant_matmul import FP8_MAX, INT8_MAX, INT8_MIN
from srt_ascend.models.quant_config import MODELSLIM_DESCRIPTION
from srt_ascend.tools.calibration import input_stats
from srt_ascend.tools.quant_sensitivity import DEFAULT_MEMORY_RATIO, choose_float, sensitivity
from srt_ascend.tools.smooth_quant import DEFAULT_ALPHA, smooth_checkpoint

SCHEMES = ("w8a8", "w8a8_dynamic", "fp8_block")
# W8A8's activation range: each calibration window's 0.01% / 99.99% quantiles, not its
# extremes (shipped checkpoint, 8 held-out windows: argmax agreement with bf16 96.5% vs 95.2%
# with min / max, perplexity 1.0002x vs 1.0065x; 99.9% clips too much: 88%, 1.036x)
CALIB_CLIP = 0.9999
FP8_BLOCK = (128, 128)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_ATTENTION = re.compile(r"^self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)$")
_KV_B = re.compile(r"^self_attn\.kv_b_proj$")
_MLP = re.compile(r"^mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)$")
_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer_scheme(name: str, scheme: str, num_layers: int, quant_mtp: bool) -> str | None:
    """The scheme of checkpoint weight `name` (ModelSlim's names, FP8_BLOCK), None: float."""
    m = _LAYER.match(name)
    if m is None or (int(m.group(1)) >= num_layers and not quant_mtp):
        return None
    module = m.group(2)
    if scheme == "fp8_block":
        hit = _ATTENTION, _KV_B, _MLP, _EXPERT
        return "FP8_BLOCK" if any(p.match(module) for p in hit) else None
    if _EXPERT.match(module):
        return "W8A8_DYNAMIC"
    if _ATTENTION.match(module) or _MLP.match(module):
        return "W8A8" if scheme == "w8a8" else "W8A8_DYNAMIC"
    return None


def quantize_per_channel(w: torch.Tensor, scale_dtype: torch.dtype):
    """Symmetric per-row int8: scale = max|w| / 127 rounded to `scale_dtype`, weight =
    round(w / scale). Returns (int8 weight, scale [N, 1], offset zeros [N, 1])."""
    scale = (w.abs().amax(-1, keepdim=True).clamp(min=1e-12) / INT8_MAX).to(scale_dtype)
    q = torch.round(w / scale.float()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale, torch.zeros_like(scale)


def quantize_block_fp8(w: torch.Tensor, block=FP8_BLOCK):
    """w [N, K] -> (float8_e4m3fn weight, float32 weight_scale_inv [ceil(N/bn), ceil(K/bk)])."""
    (n, k), (bn, bk) = w.shape, block
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [N blocks, K blocks]
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:n, :k].contiguous(), scale.float()


def static_input_params(lo: float, hi: float, dtype: torch.dtype):
    """Per-tensor asymmetric int8 over [lo, hi] (0 inside): (input_scale, input_offset)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = torch.tensor([max(hi - lo, 1e-8) / (INT8_MAX - INT8_MIN)]).to(dtype)
    offset = torch.round(INT8_MIN - lo / scale.float()).clamp(INT8_MIN, INT8_MAX)
    return scale, offset.to(torch.int8)


def _source_shards(src: str) -> list[str]:
    names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {src!r}")
    return names


@dataclass(frozen=True)
class Calibration:
    """How the quantizer uses its calibration corpus (module docstring)."""

    sequences: int = 16  # windows for W8A8's activation ranges and SmoothQuant's maxima
    clip: float | None = CALIB_CLIP  # W8A8's activation range quantile (None: extremes)
    smooth_alpha: float | None = DEFAULT_ALPHA  # SmoothQuant's migration strength (None: off)
    memory_ratio: float | None = DEFAULT_MEMORY_RATIO  # fallback budget (None: no fallback)
    sensitivity_sequences: int = 2  # windows the fallback's sensitivities are measured on


def quantize_checkpoint(
    src: str,
    dst: str,
    scheme: str,
    quant_mtp: bool = False,
    calibration: Calibration = Calibration(),
) -> str:
    """Writes the quantized copy of `src` to `dst` (module docstring), shard by shard (each
    source shard becomes one output shard of the same name, with an index when there are
    several: memory follows the largest shard, plus the float model for calibration);
    returns dst. W8A8's smoothed float checkpoint is written to `dst`/.smoothed and removed."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    dtype = _DTYPES.get(config.get("torch_dtype"), torch.bfloat16)
    shards = _source_shards(src)
    layers = config["num_hidden_layers"]
    plan, shapes = _plan(src, shards, scheme, layers, quant_mtp)
    cal = calibration
    static = {n for n, s in plan.items() if s == "W8A8"}
    os.makedirs(dst, exist_ok=True)
    smoothed = os.path.join(dst, ".smoothed")
    if static and cal.smooth_alpha is not None:
        src = smooth_checkpoint(src, smoothed, static, cal.sequences, cal.smooth_alpha)
    stats = input_stats(src, static, cal.sequences, cal.clip) if static else {}
    ranges = {n: (st.lo, st.hi) for n, st in stats.items()}
    if cal.memory_ratio is not None:
        tensors = lambda n, w: _quantize_layer(w, plan[n], dtype, ranges.get(n))  # noqa: E731
        scores = sensitivity(src, plan, tensors, cal.sensitivity_sequences)
        for name in choose_float(plan, shapes, scores, cal.memory_ratio, layers):
            del plan[name]
    weights = {f"{n}.weight": s for n, s in plan.items()}
    description = _write(src, dst, shards, weights, dtype, ranges)
    shutil.rmtree(smoothed, ignore_errors=True)
    if scheme == "fp8_block":
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK),
        }
    else:
        model_type = "W8A8" if scheme == "w8a8" else "W8A8_DYNAMIC"
        with open(os.path.join(dst, MODELSLIM_DESCRIPTION), "w") as f:
            json.dump({"model_quant_type": model_type, **dict(sorted(description.items()))}, f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def _plan(src, shards, scheme, num_layers, quant_mtp):
    """({layer: scheme} of the layers to quantize, {layer: (n, k)})."""
    plan, shapes = {}, {}
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                s = layer_scheme(name, scheme, num_layers, quant_mtp)
                if s is not None:
                    layer = name[: -len(".weight")]
                    plan[layer], shapes[layer] = s, tuple(f.get_slice(name).get_shape())
    return plan, shapes


def _write(src, dst, shards, plan, dtype, ranges) -> dict[str, str]:
    """Writes the shards of `dst` (the `plan` weights quantized, the rest copied) and their
    index; returns the description {tensor: scheme or FLOAT}."""
    description, weight_map = {}, {}
    for shard in shards:
        out = {}
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                t, s = f.get_tensor(name), plan.get(name)
                if s is None:
                    out[name], description[name] = t, "FLOAT"
                    continue
                base = name[: -len(".weight")]
                for leaf, value in _quantize_layer(t.float(), s, dtype, ranges.get(base)).items():
                    out[f"{base}.{leaf}"], description[f"{base}.{leaf}"] = value, s
        weight_map.update((name, shard) for name in out)
        contiguous = {k: v.contiguous() for k, v in sorted(out.items())}
        save_file(contiguous, os.path.join(dst, shard), metadata={"format": "pt"})
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        skip = name.endswith(".safetensors") or name.endswith(".index.json")
        if os.path.isfile(path) and not skip and name != "config.json":
            shutil.copyfile(path, os.path.join(dst, name))
    return description


def _quantize_layer(w: torch.Tensor, scheme: str, dtype: torch.dtype, rng) -> dict:
    if scheme == "FP8_BLOCK":
        q, scale_inv = quantize_block_fp8(w)
        return {"weight": q, "weight_scale_inv": scale_inv}
    q, scale, offset = quantize_per_channel(w, dtype)
    out = {"weight": q, "weight_scale": scale, "weight_offset": offset}
    if scheme == "W8A8":
        input_scale, input_offset = static_input_params(rng[0], rng[1], dtype)
        deq = (input_scale.float() * scale.float().view(-1)).float()
        out["input_scale"], out["input_offset"], out["deq_scale"] = input_scale, input_offset, deq
        out["quant_bias"] = (-int(input_offset) * q.to(torch.int32).sum(-1)).to(torch.int32)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m srt_ascend.tools.quantize", description=__doc__)
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--quant-mtp", action="store_true", help="quantize the MTP layer's block too")
    p.add_argument("--calib-sequences", type=int, default=16, help="W8A8 calibration windows")
    p.add_argument(
        "--calib-clip", type=float, default=CALIB_CLIP, help="W8A8 activation range quantile"
    )
    p.add_argument(
        "--smooth-alpha", type=float, default=DEFAULT_ALPHA, help="W8A8 SmoothQuant strength"
    )
    p.add_argument("--no-smooth", action="store_true", help="W8A8 without SmoothQuant")
    p.add_argument(
        "--memory-ratio",
        type=float,
        default=DEFAULT_MEMORY_RATIO,
        help="most sensitive layers stay FLOAT within this share of the scope's bf16 bytes",
    )
    p.add_argument("--no-fallback", action="store_true", help="quantize every layer in scope")
    p.add_argument("src")
    p.add_argument("dst")
    args = p.parse_args(argv)
    calibration = Calibration(
        sequences=args.calib_sequences,
        clip=args.calib_clip,
        smooth_alpha=None if args.no_smooth else args.smooth_alpha,
        memory_ratio=None if args.no_fallback else args.memory_ratio,
    )
    quantize_checkpoint(args.src, args.dst, args.scheme, args.quant_mtp, calibration)
    print(f"wrote {args.dst} ({args.scheme}{', MTP quantized' if args.quant_mtp else ''})")


if __name__ == "__main__":
    main()
