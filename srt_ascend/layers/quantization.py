"""Quantized layers: weights kept int8 / fp8 in memory, one method per checkpoint scheme.

A `QuantMethod` names the tensors one linear layer of its scheme holds (the checkpoint's own
names and shapes: `weight`, `weight_scale`, ...), turns them into what its matmul reads after
loading (`finish`), and computes y = x W^T from them (`linear`, the formulas of
`ops/quant_matmul.py`). Methods register by their scheme name (ModelSlim's `W8A8`,
`W8A8_DYNAMIC`; `FP8_BLOCK` for DeepSeek's block FP8); the layers below hold a method and never
branch on the scheme.

- `QuantLinear`: a linear layer's quantized weight (no bias: DeepSeek-V3's projections have
  none).
- `QuantStack`: several QuantLinears of one input as one matmul (the run-time stacks
  `stack_linears` builds, as `WeightStack` does for float layers).
- `QuantRoutedExperts` (layers/moe_quant.py): the routed experts.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.layers.linear import ordered_sum
from srt_ascend.layers.ops import quant_matmul as qm
from srt_ascend.layers.weight_stack import WeightStack

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
    # whether a row's output is the same bits in any batch (--enable-deterministic-inference):
    # the scheme's GEMM is exact (integer) and everything else it does is per row or per
    # element
    batch_invariant: ClassVar[bool] = False
    # whether tensor parallelism can split its layers (`models/loader.TP_SPLITS`): the
    # per-channel tensors split with a column-parallel layer's rows, and a row-parallel
    # layer's partial products over its input slice add up to the layer's output; why not
    # where it cannot (a one-line start error with --tp-size > 1)
    tp_problem: ClassVar[str | None] = "its tensors are not split across ranks"

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

    def experts_dense(self, x, weights, stacks: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Every routed expert over every token in few GEMMs: x [T, H], weights [T, E]
        float32 (zero where unchosen), `stacks` the experts' parameters (w13, w13_<name>,
        w2, w2_<name>) -> float32 [T, H]; None where the scheme has no such path (then each
        expert runs its own two linears)."""
        return None

    def experts_problem(self, intermediate_size: int) -> str | None:
        """Why experts of this width cannot hold their [gate; up] rows in one stack, or None."""
        return None

    # tensors whose rows are the output channels (stacked by concatenation) ...
    per_row: ClassVar[tuple[str, ...]] = ("weight",)

    def stackable(self, parts: list[dict[str, torch.Tensor]]) -> bool:
        """Whether layers with these tensors compute one stacked layer's output rows: every
        tensor that is not per row is equal in all of them."""
        first = parts[0]
        shared = [k for k in first if k not in self.per_row]
        return all(torch.equal(p[k], first[k]) for p in parts[1:] for k in shared)


@register("W8A8")
class W8A8Static(QuantMethod):
    """ModelSlim W8A8: per-tensor static activation scale and offset, per-channel weights."""

    batch_invariant = True  # int32 sums of int8 products; elementwise quantise / epilogue
    tp_problem = "its quant_bias folds the input offset over all input channels"

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

    per_row = ("weight", "weight_scale", "weight_offset", "quant_bias", "deq_scale")

    def finish(self, t):
        qm.prepare(t["weight"].device)
        return t

    def linear(self, x, t):
        return qm.w8a8_static_linear(
            x, t["weight"], t["input_scale"], t["input_offset"], t["quant_bias"], t["deq_scale"]
        )

    def dequantize(self, t):
        return (t["weight"].float() - t["weight_offset"]) * t["weight_scale"]


@register("W8A8_DYNAMIC")
class W8A8Dynamic(QuantMethod):
    """ModelSlim W8A8_DYNAMIC: per-token symmetric activations, per-channel weights."""

    batch_invariant = True  # int32 sums; per-token scales are max reductions within a row
    # Under TP a row-parallel layer (o_proj, down_proj) quantises each rank's input slice
    # per token with that slice's own max (as vllm-ascend's and SGLang's NPU paths do), not
    # the whole row's: a finer scale, so TP > 1 is not TP = 1's bits (nor is float TP's
    # all-reduce); column-parallel layers see the whole row and compute TP = 1's values.
    tp_problem = None

    def tensors(self, n, k):
        f32 = torch.float32
        return {
            "weight": ((n, k), torch.int8),
            "weight_scale": ((n, 1), f32),
            "weight_offset": ((n, 1), f32),
        }

    per_row = ("weight", "weight_scale", "weight_offset")

    def finish(self, t):
        qm.prepare(t["weight"].device)
        return {**t, "scale_row": t["weight_scale"].view(-1)}

    def linear(self, x, t):
        return qm.w8a8_dynamic_linear(x, t["weight"], t["scale_row"])

    def experts_dense(self, x, weights, stacks):
        """Each expert's linears over every token, the gate/ups of all experts as one
        quantized linear over the stacked [E * 2I, H] rows (x's rows quantised once, as
        each expert's own call would), the downs one call per expert over its [T, I] SwiGLU
        rows: the same integers, scales and outputs as the per-expert calls; off the NPU."""
        if x.device.type == "npu":
            return None
        w13, w2 = stacks["w13"], stacks["w2"]
        e, two_i, h = w13.shape
        t, inter = x.shape[0], two_i // 2
        scale13 = stacks["w13_weight_scale"].view(-1)
        gate_up = qm.w8a8_dynamic_linear(x, w13.view(e * two_i, h), scale13).view(t, e, two_i)
        act = (F.silu(gate_up[..., :inter]) * gate_up[..., inter:]).transpose(0, 1)  # [E, T, I]
        scale2 = stacks["w2_weight_scale"].view(e, h)
        ys = torch.stack([qm.w8a8_dynamic_linear(act[i], w2[i], scale2[i]) for i in range(e)])
        return ordered_sum(ys.float() * weights.t().unsqueeze(-1), 0)  # ys [E, T, H]

    def dequantize(self, t):
        return (t["weight"].float() - t["weight_offset"]) * t["weight_scale"]


@register("FP8_BLOCK")
class Fp8Block(QuantMethod):
    """DeepSeek's block FP8: float8_e4m3fn weights, one float32 factor per block."""

    tp_problem = "its per-block scales are not split across ranks"

    def tensors(self, n, k):
        bn, bk = self.block
        blocks = (-(-n // bn), -(-k // bk))
        return {"weight": ((n, k), FP8), "weight_scale_inv": (blocks, torch.float32)}

    per_row = ("weight", "weight_scale_inv")

    def stackable(self, parts):
        return all(p["weight"].shape[0] % self.block[0] == 0 for p in parts)

    def experts_problem(self, intermediate_size):
        if intermediate_size % self.block[0]:
            return (
                f"FP8 blocks of {self.block[0]} rows do not divide the experts' intermediate "
                f"size {intermediate_size} (gate and up share a stack)"
            )
        return None

    def linear(self, x, t):
        return qm.fp8_block_linear(x, t["weight"], t["weight_scale_inv"], self.block)

    def dequantize(self, t):
        return qm.dequantize_fp8_blocks(t["weight"], t["weight_scale_inv"], self.block)


def quant_parameter(shape, dtype) -> nn.Parameter:
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
            self.register_parameter(name, quant_parameter(shape, dtype))
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


class QuantStack:
    """QuantLinears of one input stacked along their output rows: one quantized matmul.
    Their per-row tensors are re-pointed at views of the stacked ones (no second copy);
    `intact()` is False once one of them gets new storage (WeightStack's rule)."""

    def __init__(self, layers: list[QuantLinear]) -> None:
        method = layers[0].method
        parts = [dict(m.named_parameters(recurse=False)) for m in layers]
        tensors = dict(parts[0])
        with torch.inference_mode(False), torch.no_grad():
            for key in method.per_row:
                stacked = torch.cat([p[key].data for p in parts])
                tensors[key] = stacked
                views = stacked.split([p[key].shape[0] for p in parts])
                for p, view in zip(parts, views):
                    p[key].data = view
        for m in layers:
            m.finish()
        self.method, self._run = method, method.finish(tensors)
        self._weights = [p["weight"] for p in parts]
        self._ptrs = [w.data_ptr() for w in self._weights]
        self._linked = True

    def intact(self) -> bool:
        if not torch.compiler.is_compiling():
            self._linked = all(w.data_ptr() == p for w, p in zip(self._weights, self._ptrs))
        return self._linked

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.linear(x, self._run)


def stack_linears(layers: list[nn.Module]) -> WeightStack | QuantStack | None:
    """One stack computing the outputs of `layers` (which read the same input) in one matmul,
    or None where they cannot be stacked: biases, float and quantized layers mixed, schemes
    that differ or whose shared tensors differ (W8A8's input scales), FP8 blocks that do not
    align."""
    if all(type(m) is not QuantLinear and isinstance(m, nn.Linear) for m in layers):
        if all(m.bias is None for m in layers):
            return WeightStack.concat([m.weight for m in layers])
        return None
    if not all(isinstance(m, QuantLinear) for m in layers):
        return None
    if len({m.method.name for m in layers}) > 1:
        return None
    parts = [dict(m.named_parameters(recurse=False)) for m in layers]
    return QuantStack(layers) if layers[0].method.stackable(parts) else None
