"""The one place that picks a device implementation for the fused NPU attention ops.

Callers (the FIA attention backend, multi-query verify) call ``fused_infer_attention_score``
with exactly the arguments of ``torch_npu.npu_fused_infer_attention_score``. Tensors on an
Ascend NPU go to the real op (``torch_npu`` is imported only then, so this module imports on
machines without it); tensors anywhere else go to the plain-torch reference in
``fia_reference``, which has the same signature, layout and validation. Device types register
in ``_FIA_LOADERS``; elsewhere only the FIA backend's compiled forward asks (``has_device_fia``)
whether to write the reference's attention into the graph instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from srt_ascend.layers.attention import fia_reference

FiaFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _load_torch_npu_fia() -> FiaFn:
    """The real op; imports torch_npu lazily (it registers the "npu" device on import)."""
    import torch_npu

    return torch_npu.npu_fused_infer_attention_score


# device type -> loader of the implementation used for tensors on that device
_FIA_LOADERS: dict[str, Callable[[], FiaFn]] = {"npu": _load_torch_npu_fia}


def resolve_fused_infer_attention_score(device_type: str) -> FiaFn:
    """The FIA implementation for tensors whose ``device.type`` is ``device_type``: the
    registered loader's op (torch_npu on "npu"), else the plain-torch reference."""
    loader = _FIA_LOADERS.get(device_type)
    if loader is None:
        return fia_reference.npu_fused_infer_attention_score
    return loader()


def has_device_fia(device_type: str) -> bool:
    """Whether tensors on ``device_type`` run a real FIA op (not the plain-torch reference)."""
    return device_type in _FIA_LOADERS


def fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``npu_fused_infer_attention_score`` for ``query``'s device with every keyword
    forwarded unchanged (see ``fia_reference`` for the supported MLA TND form).

    Returns ``(attention_out, softmax_lse)`` as the op does; both are new tensors owned by the
    caller. Inputs are only read."""
    impl = resolve_fused_infer_attention_score(query.device.type)
    return impl(query, key, value, **kwargs)
