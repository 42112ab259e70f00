"""What the loaded weights take in memory: the whole model's bytes, and the quantized scope's
bytes beside the bf16 bytes the same layers would take (issue 44's memory target, read from
the running server: /get_server_info and the internal state)."""

from __future__ import annotations

from torch import nn

from srt_ascend.layers.moe import RoutedExperts
from srt_ascend.layers.quantization import QuantModule
from srt_ascend.models.deepseek_v3 import DecoderLayer

_QUANTIZED_DTYPE_BYTES = 1  # int8 / float8_e4m3fn


def _scope_modules(layer: DecoderLayer) -> list[tuple[str, nn.Module]]:
    """The layer's linear layers and expert stacks (MLA's kv_b_proj excluded: it is served
    float, as the absorbed attention reads it)."""
    kinds = (nn.Linear, QuantModule, RoutedExperts)
    return [
        (name, m)
        for name, m in layer.named_modules()
        if isinstance(m, kinds) and not name.endswith("kv_b_proj")
    ]


def weight_memory(roots: list[nn.Module | None]) -> dict[str, int]:
    """{weight_bytes: every parameter of `roots` (shared ones once),
    quantized_weight_bytes: the quantized scope's parameters, quantized_weight_bytes_as_bf16:
    the same in bf16}. The scope: every linear layer and expert stack of a decoder layer
    (main or MTP) that holds a quantized layer, the layers a checkpoint keeps FLOAT in it
    included (ModelSlim's fallback); zeros for a float checkpoint. Bytes as held: float layers
    count in the served dtype (a float32 server's fallback layers take twice bf16's)."""
    mods = [r for r in roots if r is not None]
    params = {id(p): p for r in mods for p in r.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    seen: set[int] = set()
    held = as_bf16 = 0
    for layer in (m for r in mods for m in r.modules() if isinstance(m, DecoderLayer)):
        if not any(isinstance(m, QuantModule) for m in layer.modules()):
            continue
        for _, module in _scope_modules(layer):
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                held += p.numel() * p.element_size()
                if p.element_size() == _QUANTIZED_DTYPE_BYTES or not isinstance(
                    module, QuantModule
                ):
                    as_bf16 += 2 * p.numel()
    return {
        "weight_bytes": total,
        "quantized_weight_bytes": held,
        "quantized_weight_bytes_as_bf16": as_bf16,
    }
