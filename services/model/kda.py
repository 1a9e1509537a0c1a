"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay.

Kimi Linear section 4 and fla's KDA layer (docs/paper-notes.md 6.1): q, k, v from short convolutions
with SiLU, L2-normalised q and k, decay g = -exp(A_log) * softplus(W_f x + dt_bias) through a
low-rank W_f (rank = gate_rank), beta = sigmoid(W_b x); the output is a head-wise RMSNorm
times a low-rank sigmoid gate, then W_o.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.model.cache import LinearState
from services.model.config import ModelConfig
from services.model.delta_core import DeltaCore, DeltaMixer, decay
from services.model.linear import Linear
from services.model.norm import RMSNorm


class KDA(DeltaMixer):
    """One KDA mixer. State per request: [1, H, Dk, Dv] fp32 plus the conv tail."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d, c, rank = cfg.linear_heads, cfg.linear_head_dim, cfg.d_model, cfg.gate_rank
        self.heads, self.head_dim = h, d
        self.core = DeltaCore(cfg)
        self.f_down = Linear(c, rank, bias=False)
        self.f_up = Linear(rank, h * d, bias=False)
        self.a_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h * d))
        self.g_down = Linear(c, rank, bias=False)
        self.g_up = Linear(rank, h * d, bias=False)
        self.o_norm = RMSNorm(d, cfg.norm_eps)
        self.o_proj = Linear(h * d, c, bias=False)

    def _decay(self, x: Tensor) -> Tensor:
        """x [B, T, C] -> per-channel log-decay g [B, T, H, D] fp32."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        raw = self.f_up(self.f_down(x)).view(b, t, h, d)
        return decay(self.a_log.view(h, 1), raw, self.dt_bias.view(h, d))

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """o [B, T, H, D] -> o_proj(RMSNorm(o) * sigmoid gate) [B, T, C]."""
        b, t, h, d = o.shape
        gate = torch.sigmoid(self.g_up(self.g_down(x))).view(b, t, h, d)
        out: Tensor = self.o_proj((self.o_norm(o) * gate).reshape(b, t, h * d))
        return out

    def decode(self, x: Tensor, cache: LinearState) -> Tensor:
        """x [B, 1, C] against a batched LinearState [B, ...], updated in place."""
        return self._output(x, self.core.decode(x, self._decay(x)[:, 0], cache))
