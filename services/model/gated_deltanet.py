"""Gated DeltaNet: the gated delta rule with one scalar decay per head (Qwen3-Next's linear
layer; GDN paper section 3, docs/paper-notes.md 6.3).

q, k, v from short convolutions with SiLU, L2-normalised q and k; alpha = exp(g) with
g = -exp(A_log) * softplus(W_a x + dt_bias) per head; beta = sigmoid(W_b x); the output is an
RMSNorm per head times SiLU(W_z x) (Qwen's gated norm), then W_o.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.model.cache import LinearState
from services.model.config import ModelConfig
from services.model.delta_core import DeltaCore, DeltaMixer, decay
from services.model.linear import Linear
from services.model.norm import RMSNorm


class GatedDeltaNet(DeltaMixer):
    """One Gated DeltaNet mixer. State per request: [1, H, Dk, Dv] fp32 plus the conv tail."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d, c = cfg.linear_heads, cfg.linear_head_dim, cfg.d_model
        self.heads, self.head_dim = h, d
        self.core = DeltaCore(cfg)
        self.a_proj = Linear(c, h, bias=False)
        self.a_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.z_proj = Linear(c, h * d, bias=False)
        self.o_norm = RMSNorm(d, cfg.norm_eps)
        self.o_proj = Linear(h * d, c, bias=False)

    def _decay(self, x: Tensor) -> Tensor:
        """x [B, T, C] -> per-head log-decay g [B, T, H, 1] fp32."""
        return decay(self.a_log, self.a_proj(x), self.dt_bias)[..., None]

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """o [B, T, H, D] -> o_proj(RMSNorm(o) * SiLU gate) [B, T, C]."""
        b, t, h, d = o.shape
        gate = F.silu(self.z_proj(x)).view(b, t, h, d)
        out: Tensor = self.o_proj((self.o_norm(o) * gate).reshape(b, t, h * d))
        return out

    def decode(self, x: Tensor, cache: LinearState) -> Tensor:
        """x [B, 1, C] against a batched LinearState [B, ...], updated in place."""
        g = decay(self.a_log, self.a_proj(x[:, 0]), self.dt_bias)  # [B, H]
        return self._output(x, self.core.decode(x, g[..., None], cache))
