"""Which layers to leave float: measured sensitivity under a memory budget.

Quantizing every layer of a small model costs more than its quantisation error suggests: a
few layers (the first dense layer's down_proj, whose inputs carry the massive activations;
some attention projections) move the greedy continuation far more than the rest. ModelSlim
marks such layers `FLOAT` in quant_model_description.json (its fallback list); this picks them:

- sensitivity of a layer: the mean KL divergence of the next-token distributions (main
  model, and the MTP layer's drafts when it is loaded) between the float model and the float
  model with only that layer computed by its quantized formula (the serving op on this
  machine, the tensors `srt_ascend.tools.quantize` writes), over calibration windows;
- fallback: layers by decreasing sensitivity stay float while the quantized scope's bytes
  in memory (every layer the scheme quantizes, MoE experts always quantized) stay within
  `memory_ratio` of its bf16 bytes: the serving memory target of issue 44 is 0.55.

MLA's kv_b_proj (dequantised at load) and the routed experts (one scheme per expert stack)
are never candidates.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from srt_ascend.layers.quantization import QUANT_METHODS

DEFAULT_MEMORY_RATIO = 0.55
_NOT_CANDIDATE = re.compile(r"\.(mlp\.experts\.\d+\.\w+|self_attn\.kv_b_proj)$")


def quantized_bytes(scheme: str, n: int, k: int) -> int:
    """Bytes a [n, k] layer of `scheme` holds in memory (its method's tensors)."""
    shapes = QUANT_METHODS[scheme]().tensors(n, k).values()
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes)


def in_scope(layer: str) -> bool:
    """Whether a quantized layer counts in the memory scope (kv_b_proj does not: served
    float)."""
    return not layer.endswith(".self_attn.kv_b_proj")


def choose_float(
    plan: dict[str, str],
    shapes: dict[str, tuple[int, int]],
    scores: dict[str, float],
    memory_ratio: float,
    num_layers: int,
) -> list[str]:
    """The layers (by decreasing score) kept float so that the scope's bytes stay within
    `memory_ratio` of its bf16 bytes, the main model's layers and the MTP layers'
    (`num_layers` and above) each on their own: a server loads the main model with or without
    the MTP layer. `plan`: layer -> scheme (all quantized layers); `shapes`: layer -> (n, k);
    `scores`: candidate layer -> sensitivity. A layer that does not fit is skipped and
    smaller ones are still tried."""
    is_mtp = lambda name: int(name.split(".")[2]) >= num_layers  # noqa: E731
    chosen = []
    for part in (False, True):
        scope = [n for n in plan if in_scope(n) and is_mtp(n) == part]
        budget = memory_ratio * sum(2 * shapes[n][0] * shapes[n][1] for n in scope)
        used = sum(quantized_bytes(plan[n], *shapes[n]) for n in scope)
        for name in sorted(scores, key=lambda n: -scores[n]):
            if is_mtp(name) != part:
                continue
            n, k = shapes[name]
            extra = 2 * n * k - quantized_bytes(plan[name], n, k)
            if used + extra <= budget:
                chosen.append(name)
                used += extra
    return chosen


def candidates(plan: dict[str, str]) -> list[str]:
    return [n for n in plan if not _NOT_CANDIDATE.search(n)]


def _quantized_forward(scheme: str, tensors: dict[str, torch.Tensor], block):
    """A forward hook computing the layer's output by its quantized method (serving's op)."""
    method = QUANT_METHODS[scheme](block)
    dtypes = {k: dt for k, (_, dt) in method.tensors(1, 1).items()}
    run = method.finish({k: v.to(dtypes[k]) for k, v in tensors.items()})

    def hook(_module, args, out):
        return method.linear(args[0], run).to(out.dtype)

    return hook


def sensitivity(
    src: str,
    plan: dict[str, str],
    layer_tensors,
    sequences: int,
    block: tuple[int, int] = (128, 128),
    seq_len: int = 128,
) -> dict[str, float]:
    """{candidate layer: mean KL(float || that layer quantized)} over `sequences` windows of
    `seq_len` tokens (one float run, then one run per candidate).
    `layer_tensors(name, weight float32)` -> the layer's quantized tensors as written."""
    from srt_ascend.tools.calibration import CalibrationModel, calibration_windows, num_layers

    names = candidates(plan)
    layers = num_layers(src)
    run = CalibrationModel(src, any(int(n.split(".")[2]) >= layers for n in names))
    windows = calibration_windows(src, sequences, seq_len)
    reference = [torch.log_softmax(x, -1) for x in run.logits(windows)]
    scores = {}
    for name in names:
        weight = run.linears[name].weight.detach().float()
        hook = _quantized_forward(plan[name], layer_tensors(name, weight), block)
        (handle,) = run.with_hooks({name: hook})
        kl = [
            F.kl_div(torch.log_softmax(x, -1), ref, log_target=True, reduction="batchmean").item()
            for x, ref in zip(run.logits(windows), reference)
        ]
        handle.remove()
        scores[name] = sum(kl) / len(kl)
    return scores
