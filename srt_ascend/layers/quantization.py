"""Quantized layers: weights kept int8 / fp8 in memory, one method per checkpoint scheme.

A `QuantMethod` names the tensors one linear layer of its scheme holds (the checkpoint's own
names and shapes: `weight`, `weight_scale`, ...), turns them into what its matmul reads after
loading (`finish`), and computes y = x W^T from them (`linear`, the formulas of
`ops/quant_matmul.py`). Methods register by their scheme name (ModelSlim's `W8A8`,
`W8A8_DYNAMIC`; `FP8_BLOCK` for DeepSeek's block FP8); the layers below hold a method and never
branch on the scheme.

- `QuantLinear`: a linear layer's quantized weight (no bias: DeepSeek-V3's projections have
  none).
- `QuantRoutedExperts`: the routed experts' stacks w13 [E, 2I, H] / w2 [E, H, I] in the
  scheme's dtype with per-expert scale stacks (`w13_weight_scale`, ...). Every MoE path runs
  each expert's two quantized linears: sparse and ordered over the tokens that chose the
  expert, dense and gathered (fixed shapes: graphs, accelerators) every expert over every
  token with weight zero where unchosen.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.layers.moe import RoutedExperts
from srt_ascend.layers.ops import quant_matmul as qm

FP8 = torch.float8_e4m3fn
QUANT_METHODS: dict[str, type[QuantMethod]] = {}


def register(name: str):
    def wrap(cls):
        cls.name = name
        QUANT_METHODS[name] = cls
        return cls

    return wrap


class QuantMethod:
    """One scheme's tensors and matmul. `block`: block FP8's (rows, columns) per scale."""

    name: ClassVar[str] = ""

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        self.block = block

    def tensors(self, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype in memory) of a [n, k] linear's checkpoint tensors."""
        raise NotImplementedError

    def finish(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loaded tensors -> what `linear` reads (views where possible)."""
        return t

    def linear(self, x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight [n, k] the quantized one stands for."""
        raise NotImplementedError


@register("W8A8")
class W8A8Static(QuantMethod):
    """ModelSlim W8A8: per-tensor static activation scale and offset, per-channel weights."""

    def tensors(self, n, k):
        f32 = torch.float32
        return {
            "weight": ((n, k), torch.int8),
            "weight_scale": ((n, 1), f32),
            "weight_offset": ((n, 1), f32),
            "input_scale": ((1,), f32),
            "input_offset": ((1,), f32),
            "quant_bias": ((n,), torch.int32),
            "deq_scale": ((n,), f32),
        }

    def linear(self, x, t):
        return qm.w8a8_static_linear(
            x, t["weight"], t["input_scale"], t["input_offset"], t["quant_bias"], t["deq_scale"]
        )

    def dequantize(self, t):
        return (t["weight"].float() - t["weight_offset"]) * t["weight_scale"]


@register("W8A8_DYNAMIC")
class W8A8Dynamic(QuantMethod):
    """ModelSlim W8A8_DYNAMIC: per-token symmetric activations, per-channel weights."""

    def tensors(self, n, k):
        f32 = torch.float32
        return {
            "weight": ((n, k), torch.int8),
            "weight_scale": ((n, 1), f32),
            "weight_offset": ((n, 1), f32),
        }

    def finish(self, t):
        return {**t, "scale_row": t["weight_scale"].view(-1)}

    def linear(self, x, t):
        return qm.w8a8_dynamic_linear(x, t["weight"], t["scale_row"])

    def dequantize(self, t):
        return (t["weight"].float() - t["weight_offset"]) * t["weight_scale"]


@register("FP8_BLOCK")
class Fp8Block(QuantMethod):
    """DeepSeek's block FP8: float8_e4m3fn weights, one float32 factor per block."""

    def tensors(self, n, k):
        bn, bk = self.block
        blocks = (-(-n // bn), -(-k // bk))
        return {"weight": ((n, k), FP8), "weight_scale_inv": (blocks, torch.float32)}

    def linear(self, x, t):
        return qm.fp8_block_linear(x, t["weight"], t["weight_scale_inv"], self.block)

    def dequantize(self, t):
        bn, bk = self.block
        n, k = t["weight"].shape
        s = t["weight_scale_inv"].float().repeat_interleave(bn, 0)[:n]
        return t["weight"].float() * s.repeat_interleave(bk, 1)[:, :k]


def _parameter(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantModule(nn.Module):
    """A layer whose parameters the loader fills as they are on disk and never casts to the
    model's dtype; `finish` is called once after loading."""

    def finish(self) -> None:
        raise NotImplementedError


class QuantLinear(QuantModule):
    """y = x W^T with W held as `method`'s quantized tensors (parameters named as on disk)."""

    bias = None

    def __init__(self, in_features: int, out_features: int, method: QuantMethod) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method = in_features, out_features, method
        for name, (shape, dtype) in method.tensors(out_features, in_features).items():
            self.register_parameter(name, _parameter(shape, dtype))
        self._run: dict[str, torch.Tensor] | None = None

    def finish(self) -> None:
        self._run = self.method.finish(dict(self.named_parameters(recurse=False)))

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._run is None:
            self.finish()
        return self._run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.linear(x, self._tensors())

    def dequantize(self) -> torch.Tensor:
        return self.method.dequantize(self._tensors())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.method.name}"


class QuantRoutedExperts(RoutedExperts, QuantModule):
    """RoutedExperts whose stacks hold `method`'s tensors: `w13` / `w2` the quantized weights
    [E, 2I, H] / [E, H, I], `w13_<name>` / `w2_<name>` each per-expert scale tensor stacked
    (the loader maps them to `experts.{e}.{gate,up,down}_proj.<name>`)."""

    stackable = False  # the shared expert is not appended as row E (DeepseekMoE.fuse_weights)

    def __init__(self, experts: RoutedExperts, method: QuantMethod) -> None:
        e, two_i, h = experts.w13.shape
        inter = experts.intermediate_size
        super().__init__(e, h, inter, experts.first_expert, experts.partitioned)
        self.method = method
        for stack, (n, k) in (("w13", (two_i, h)), ("w2", (h, inter))):
            for name, (shape, dtype) in method.tensors(n, k).items():
                key = stack if name == "weight" else f"{stack}_{name}"
                self.register_parameter(key, _parameter((e, *shape), dtype))
        self._run: list[tuple[dict, dict]] | None = None

    def finish(self) -> None:
        """Per expert: the method's view of its w13 and w2 tensors."""
        params = dict(self.named_parameters(recurse=False))
        per_expert = []
        for e in range(self.n_experts):
            pair = []
            for stack in ("w13", "w2"):
                t = {
                    ("weight" if k == stack else k[len(stack) + 1 :]): v[e]
                    for k, v in params.items()
                    if k == stack or k.startswith(stack + "_")
                }
                pair.append(self.method.finish(t))
            per_expert.append(tuple(pair))
        self._run = per_expert

    def _expert_at(self, x, e: int, w13, w2) -> torch.Tensor:
        if self._run is None:
            self.finish()
        t13, t2 = self._run[e]
        gate, up = self.method.linear(x, t13).chunk(2, dim=-1)
        return self.method.linear(F.silu(gate) * up, t2)

    def forward_dense(self, x, topk_weights, topk_ids, stacks=None) -> torch.Tensor:
        """Every expert over every token (fixed shapes), as `forward_ordered_dense`."""
        return self.forward_ordered(x, topk_weights, topk_ids, None, every_token=True)

    forward_gathered = forward_dense
