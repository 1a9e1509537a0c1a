"""Rotary position embedding (rotate-half form) for the GQA and SWA layers.

Angles are computed from absolute positions on the fly, so prefill at any offset and decode
steps of requests at different lengths share one code path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Rotary(nn.Module):
    """Applies RoPE with base `theta` over the full head dimension."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = (1.0 / theta**exponents).float()  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [...] (int) -> cos, sin [..., D/2] fp32."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., D/2]
        return freqs.cos(), freqs.sin()



def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] with cos/sin broadcastable to [..., D/2]; returns x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
