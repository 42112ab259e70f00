"""Which quantized format a checkpoint is in, and which of its tensors each scheme covers.

Detected from the checkpoint as SGLang does: a `quant_model_description.json` (msModelSlim)
means `modelslim`; `quantization_config.quant_method` "fp8" in config.json means DeepSeek's
block FP8. `--quantization` (SGLang's flag and values) names the format the checkpoint must
be in; a checkpoint in another format, or in none, is a one-line start error.

- modelslim: the description maps every tensor name to a scheme (`W8A8`, `W8A8_DYNAMIC`,
  `FLOAT`, ...); a layer is quantized by the scheme of its `<layer>.weight`. A scheme this
  runtime has no method for is an error naming the tensor. A `*norm.bias` tensor (anti-outlier
  smoothing) makes that RMSNorm add it. `deq_scale` stored as int64 (fp16
  models: float32 bits in the low word) is read as float32.
- fp8: the layers whose `<layer>.weight_scale_inv` is in the checkpoint are quantized, with
  `quantization_config.weight_block_size` blocks (default 128 x 128).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from srt_ascend.layers.quantization import QUANT_METHODS, QuantMethod
from srt_ascend.server_args import QUANTIZATION_FORMATS

MODELSLIM_DESCRIPTION = "quant_model_description.json"
FLOAT_SCHEME = "FLOAT"


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class QuantConfig:
    format: str  # QUANTIZATION_FORMATS
    schemes: dict[str, str] = field(default_factory=dict)  # "<layer>.weight" -> scheme
    block: tuple[int, int] = (128, 128)
    norm_biases: frozenset[str] = frozenset()  # ModelSlim's "<norm>.bias" tensors

    def method_for(self, weight_name: str) -> QuantMethod | None:
        """The method of the layer whose weight is `weight_name`; None: kept float."""
        scheme = self.schemes.get(weight_name)
        return None if scheme is None else QUANT_METHODS[scheme](self.block)

    def from_disk(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the model holds it (ModelSlim's int64 deq_scale: its low
        32 bits are the float32 value)."""
        if name.endswith(".deq_scale") and tensor.dtype == torch.int64:
            return tensor.contiguous().view(torch.int32)[..., 0::2].view(torch.float32)
        return tensor


def quantization_config_dict(config) -> dict:
    qc = getattr(config, "quantization_config", None) or {}
    return qc if isinstance(qc, dict) else qc.to_dict()


def detect_quantization(model_path: str, config) -> str | None:
    """The checkpoint's quantized format (QUANTIZATION_FORMATS), or None for a float one."""
    if os.path.isfile(os.path.join(model_path, MODELSLIM_DESCRIPTION)):
        return "modelslim"
    method = quantization_config_dict(config).get("quant_method")
    if method is None:
        return None
    if method != "fp8":
        raise QuantConfigError(
            f"{model_path}: quantization_config.quant_method {method!r} is not served "
            f"(served: {', '.join(QUANTIZATION_FORMATS)})"
        )
    return "fp8"


def resolve_quantization(
    model_path: str, config, forced: str | None, shards: list[str]
) -> QuantConfig | None:
    """The QuantConfig the model is built with: detected, or `forced` (--quantization), which
    must be what the checkpoint holds. `shards`: the checkpoint's safetensors files."""
    found = detect_quantization(model_path, config)
    if forced is not None and forced != found:
        what = f"a {found} checkpoint" if found else "not a quantized checkpoint"
        raise QuantConfigError(f"--quantization {forced}: {model_path} is {what}")
    if found == "modelslim":
        return _modelslim(model_path)
    if found == "fp8":
        return _fp8(config, shards)
    return None


def refused_with(quantization: QuantConfig, server_args) -> str | None:
    """Why these settings cannot serve a quantized checkpoint (one line), or None."""
    name = f"a quantized checkpoint ({quantization.format})"
    if server_args.tp_size > 1:
        for scheme in sorted(set(quantization.schemes.values())):
            if why := QUANT_METHODS[scheme].tp_problem:
                return f"{name} with --tp-size > 1 is not supported for {scheme} layers ({why})"
    variant = sorted(s for s in set(quantization.schemes.values()) if not _invariant(s))
    if server_args.enable_deterministic_inference and variant:
        return (
            f"{name} with --enable-deterministic-inference is not supported: {variant[0]} "
            "layers have no batch-invariant kernel (their float GEMM's sums follow the batch)"
        )
    if server_args.enable_torch_compile:
        return (
            f"{name} with --enable-torch-compile is not supported yet (the quantized layers' "
            "fused ops are not traced by torch.compile); serve it without the flag"
        )
    return None


def _invariant(scheme: str) -> bool:
    return QUANT_METHODS[scheme].batch_invariant


def _modelslim(model_path: str) -> QuantConfig:
    path = os.path.join(model_path, MODELSLIM_DESCRIPTION)
    with open(path) as f:
        description = json.load(f)
    schemes = {}
    for name, scheme in description.items():
        if not name.endswith(".weight") or scheme == FLOAT_SCHEME:
            continue
        if scheme not in QUANT_METHODS or scheme == "FP8_BLOCK":
            served = ", ".join(s for s in ("W8A8", "W8A8_DYNAMIC", FLOAT_SCHEME))
            raise QuantConfigError(
                f"{path}: {name}: scheme {scheme!r} is not served (served: {served})"
            )
        schemes[name] = scheme
    norm_biases = frozenset(n for n in description if n.endswith("norm.bias"))
    return QuantConfig("modelslim", schemes, norm_biases=norm_biases)


def _fp8(config, shards: list[str]) -> QuantConfig:
    qc = quantization_config_dict(config)
    block = tuple(int(b) for b in (qc.get("weight_block_size") or (128, 128)))
    suffix = "_scale_inv"
    schemes = {}
    for path in shards:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(".weight" + suffix):
                    schemes[name[: -len(suffix)]] = "FP8_BLOCK"
    return QuantConfig("fp8", schemes, block)
