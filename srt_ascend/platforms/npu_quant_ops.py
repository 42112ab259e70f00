"""torch_npu's quantized matmuls for NPU tensors, with the semantics of the references in
`layers/ops/quant_matmul.py` (which picks these for tensors on an NPU). torch_npu is imported
when a function first runs."""

from __future__ import annotations

import torch


def w8a8_static(x, wq, input_scale, input_offset, quant_bias, deq_scale):
    """npu_quantize divides by the scale (div_mode=True) and adds the offset, saturating to
    int8; npu_quant_matmul adds the int32 bias before dequantising by deq_scale."""
    import torch_npu

    k = x.shape[-1]
    xq = torch_npu.npu_quantize(
        x, input_scale.expand(k), input_offset.expand(k), torch.qint8, -1, True
    )
    return torch_npu.npu_quant_matmul(xq, wq.t(), deq_scale, bias=quant_bias, output_dtype=x.dtype)


def w8a8_dynamic(x, wq, weight_scale):
    """npu_dynamic_quant: per-token symmetric int8 (scale = max|x| / 127)."""
    import torch_npu

    xq, s = torch_npu.npu_dynamic_quant(x)
    return torch_npu.npu_quant_matmul(
        xq, wq.t(), weight_scale, pertoken_scale=s, output_dtype=x.dtype
    )
