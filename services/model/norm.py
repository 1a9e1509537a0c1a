"""RMSNorm: the normalisation of every block, of MLA's latent and of linear-attention heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in fp32 (weight starts at 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel instead of six elementwise passes (equal to `rms_norm_reference`).
        out = F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps)
        return out.to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The obvious x / rms(x) * weight in fp32, rounded once to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
