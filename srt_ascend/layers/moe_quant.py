"""Quantized routed experts: the stacks w13 [E, 2I, H] / w2 [E, H, I] in a quantized
scheme's dtype, with per-expert scale stacks (`w13_weight_scale`, ...). Every MoE path runs each
expert's two quantized linears (`layers.quantization` methods): sparse and ordered over the
tokens that chose the expert, dense and gathered (fixed shapes: graphs, accelerators) every
expert over every token with weight zero where unchosen (no routing-dependent shapes, no host
read), batched where the scheme can (W8A8_DYNAMIC: one gate/up GEMM over all experts; a
grouped quantized GEMM, torch_npu's npu_grouped_matmul, is the next step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt_ascend.layers.moe import RoutedExperts
from srt_ascend.layers.quantization import QuantMethod, QuantModule, quant_parameter


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
                self.register_parameter(key, quant_parameter((e, *shape), dtype))
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
        """Every expert over every token (fixed shapes): the scheme's batched path where it
        has one (`QuantMethod.experts_dense`), else each expert's own linears
        (`forward_ordered_dense`)."""
        weights = self._weights_by_expert(topk_weights, topk_ids, self.n_experts)
        y = self.method.experts_dense(x, weights, dict(self.named_parameters(recurse=False)))
        if y is None:
            return self.forward_ordered(x, topk_weights, topk_ids, None, every_token=True)
        return y.to(x.dtype)

    forward_gathered = forward_dense
