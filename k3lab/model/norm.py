"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight (weight initialised to 1).

It runs in the dtype of x: the weight is cast to it (a no-op for fp32 x, so fp32 results are those of
``F.rms_norm`` with the fp32 weight), which lets ``F.rms_norm`` take its fused kernel under bf16 autocast
(x bf16, weight fp32) instead of the unfused fallback a dtype mismatch forces.
"""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x [..., dim] -> [..., dim] in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
