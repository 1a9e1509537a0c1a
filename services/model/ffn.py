"""The SwiGLU feed-forward block shared by every layer of every family."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from services.model.linear import Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one fused projection."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_up = Linear(d_model, 2 * hidden, bias=False)
        self.down = Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)  # [..., F] each
        out: Tensor = self.down(F.silu(gate) * up)
        return out
