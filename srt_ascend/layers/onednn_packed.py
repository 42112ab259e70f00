"""oneDNN-prepacked weights: the bf16 CPU linears of batch-invariant mode
(`--enable-deterministic-inference`, `linear.linear`).

Batch-invariant mode must run every call of a layer, whatever its row count, through one
kernel (a decode step's one row and a prefill's thousands give a token the same bits), and on
CPU only oneDNN is fast at thousands of rows. A plain `F.linear` call reorders the weight into
oneDNN's blocked layout on every call, which costs about as much as the one-row product itself
(a 512 x 256 bf16 weight, one row: 48 us a plain call, 17 us on the packed copy) and makes a
decode step's 30-odd small products the mode's main cost. Here a weight is reordered once
(`mkldnn._reorder_linear_weight`) and the product runs on the packed copy
(`mkldnn._linear_pointwise`, inductor's frozen-linear op): no global switch (unlike routing a
call to PyTorch's own kernel, `torch.backends.mkldnn.enabled` is left alone), the same
kernel family for every row count, and a row plan probed on the packed op itself
(`row_plan.linear_plan(..., packed=True)`).

The packed copy lives on the weight's base tensor (a parameter, a `WeightStack`'s tensor), one
per view layout read, so it is freed with it; any in-place write to that tensor (its version
counter moves) drops its copies, which are packed again at the next call. Cost: one more copy
of every bf16 weight the mode reads (the weights' memory twice). Inference tensors
(no version counter: a write could not be seen) and dtypes or builds oneDNN does not serve
stay on `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_ATTR = "_srt_derived"  # on a base tensor: (its version, {key: derived tensor})
_DTYPES = (torch.bfloat16,)
_usable: bool | None = None


def usable() -> bool:
    """Whether this build's oneDNN serves packed bf16 linears on this CPU."""
    global _usable
    if _usable is None:
        ops = torch.ops.mkldnn
        _usable = bool(
            torch._C._has_mkldnn  # what torch.backends.mkldnn answers
            and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_is_mkldnn_bf16_supported")
            and ops._is_mkldnn_bf16_supported()
        )
    return _usable


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in oneDNN's blocked layout (a new tensor; `weight` is unchanged)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows, K] over `pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def derived(source: torch.Tensor, key: tuple, build: Callable[[], torch.Tensor]):
    """`build()` (a tensor computed from `source`), kept on source's base tensor under `key`
    and built again after any in-place write to that tensor; None for an inference tensor,
    whose writes are not counted. Built outside inference mode, so a derived tensor can
    itself hold derived ones."""
    base = source if source._base is None else source._base
    try:
        version = base._version
    except RuntimeError:
        return None
    held = getattr(base, _ATTR, None)
    if held is None or held[0] != version:
        held = (version, {})
        setattr(base, _ATTR, held)
    got = held[1].get(key)
    if got is None:
        with torch.inference_mode(False), torch.no_grad():
            got = held[1][key] = build()
    return got


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `weight` (`derived`), or None where this weight stays on
    F.linear."""
    if weight.dtype not in _DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not usable() or torch.compiler.is_compiling():
        return None
    key = ("packed", weight.data_ptr(), tuple(weight.shape), weight.stride())
    return derived(weight, key, lambda: pack(weight))
