"""RMSNorm as DeepSeek-V3 defines it (statistics in float32, weight applied in the input dtype),
plus a bias where a checkpoint has one (msModelSlim's anti-outlier smoothing writes
`*norm.bias`; the loader adds the parameter for those norms only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.register_parameter("bias", None)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) in float32 (torch's fused rms_norm), then the weight
        (and the bias, if any)."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if self.bias is None else out + self.bias
