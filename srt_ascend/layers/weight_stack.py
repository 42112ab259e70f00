"""Run-time weight stacks: several parameters re-pointed at views of one tensor, so that one
matmul reads what several modules own (SGLang's `fused_qkv_a_proj_with_mqa` and
`gate_up_proj`, built after loading instead of by the loader).

The parameters keep their names, shapes and values: `state_dict`, checkpoint loading and
in-place updates (`copy_`) all still work, and write through to the stack. Anything that gives
a parameter new storage (a dtype or device move, `p.data = ...`) breaks the link; `intact()`
then reports False and the owning module goes back to its unstacked path.

Under torch.compile `intact()` gives the answer of its last eager call (the compiler runs each
forward eagerly before tracing it), a constant of the compiled graph with no data-pointer
guard: a compiled forward holds its weights as they were then (freezing folds them in), so it
is rebuilt, not re-checked, after weights get new storage.
"""

from __future__ import annotations

import torch
from torch import nn

from srt_ascend.layers.linear import linear


class WeightStack:
    def __init__(self, tensor: torch.Tensor, views: list[tuple[nn.Parameter, torch.Tensor]]):
        with torch.inference_mode(False), torch.no_grad():
            for param, view in views:
                if param.shape != view.shape:
                    raise ValueError(f"stack view {tuple(view.shape)} for {tuple(param.shape)}")
                view.copy_(param.data)
                param.data = view
        self.tensor = tensor
        self._params = [p for p, _ in views]
        self._ptrs = [v.data_ptr() for _, v in views]
        self._linked = True  # the last eager answer of intact()

    @classmethod
    def concat(cls, params: list[nn.Parameter], dim: int = 0) -> WeightStack:
        """Parameters concatenated along `dim` (each one a slice of the result)."""
        sizes = [p.shape[dim] for p in params]
        shape = list(params[0].shape)
        shape[dim] = sum(sizes)
        with torch.inference_mode(False):
            tensor = params[0].data.new_empty(shape)
        return cls(tensor, list(zip(params, tensor.split(sizes, dim=dim))))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] times the stack's rows (`layers.linear.linear`)."""
        return linear(x, self.tensor)

    def intact(self) -> bool:
        if not torch.compiler.is_compiling():
            self._linked = all(p.data_ptr() == ptr for p, ptr in zip(self._params, self._ptrs))
        return self._linked
