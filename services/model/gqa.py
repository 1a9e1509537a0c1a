"""Grouped-query attention with RoPE, optionally with Qwen3-Next's sigmoid output gate
(Output = Attention(Q, K, V) * sigmoid(W_theta x), docs/paper-notes.md 6.3).

K and V are cached per token after RoPE, as [H_kv, capacity, D] each. Decode attends per
request over its own cache (lengths differ); projections and the FFN stay batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from services.model.attention import (
    causal_attention,
    padded_decode_attention,
    ragged_decode_attention,
)
from services.model.cache import CacheError, TokenKV
from services.model.config import ModelConfig
from services.model.linear import Linear
from services.model.padded_kv import PaddedKV
from services.model.rope import Rotary, rotate


class RopeQKV(nn.Module):
    """Fused q/k/v projection with RoPE at given positions (shared by GQA and SWA)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.proj = Linear(cfg.d_model, (self.hq + 2 * self.hkv) * self.d, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, C], positions [T] or [B, T] -> q [B, T, Hq, D], k, v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        q, k, v = self.proj(x).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1
        )
        cos, sin = self.rotary.angles(positions)  # [(B,) T, D/2]
        cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
        q = rotate(q.view(b, t, self.hq, self.d), cos, sin)
        k = rotate(k.view(b, t, self.hkv, self.d), cos, sin)
        return q, k, v.view(b, t, self.hkv, self.d)


class GQA(nn.Module):
    """One GQA mixer (optionally output-gated)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.d = cfg.n_heads, cfg.head_dim
        self.qkv = RopeQKV(cfg)
        inner = cfg.n_heads * cfg.head_dim
        self.gate = Linear(cfg.d_model, inner, bias=False) if cfg.attn_output_gate else None
        self.o_proj = Linear(inner, cfg.d_model, bias=False)

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """o [B, T, Hq * D] -> gated, projected [B, T, C]."""
        if self.gate is not None:
            o = o * torch.sigmoid(self.gate(x))
        out: Tensor = self.o_proj(o)
        return out

    def forward(self, x: Tensor, cache: TokenKV | None = None, pos0: int = 0,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, list[None]]:
        """x [B, T, C] -> [B, T, C]; with a cache (B == 1) K and V are appended to it."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x, torch.arange(pos0, pos0 + t, device=x.device))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if cache is not None:
            if b != 1 or cache.length != pos0:
                raise CacheError(f"GQA prefill takes B == 1 at the cache length, got B={b}")
            cache.append([k[0], v[0]])
            k, v = (view[None] for view in cache.views())  # [1, Hkv, L, D]
        o = causal_attention(q, k, v)  # [B, Hq, T, D]
        o = o.transpose(1, 2).reshape(b, t, self.hq * self.d)
        return self._output(x, o), [None] * len(snapshot_at)

    def decode(self, x: Tensor, caches: Sequence[TokenKV] | PaddedKV,
               positions: Tensor) -> Tensor:
        """x [B, 1, C], positions [B]; request i attends over its KV plus its new token: a
        decode batch's PaddedKV, or caches[i] (the per-request reference path)."""
        b = x.shape[0]
        q, k, v = self.qkv(x, positions[:, None])  # [B, 1, H, D]
        if isinstance(caches, PaddedKV):
            keys, values = caches.append([k[:, 0], v[:, 0]])  # [B, Hkv, Lmax, D]
            o = padded_decode_attention(q[:, 0], keys, values, caches.lengths + 1)
        else:
            for i, kv in enumerate(caches):
                kv.append([k[i].transpose(0, 1), v[i].transpose(0, 1)])  # [Hkv, 1, D]
            views = [kv.views() for kv in caches]  # [Hkv, L, D] each
            o = ragged_decode_attention(q[:, 0], [x[0] for x in views], [x[1] for x in views])
        return self._output(x, o.reshape(b, 1, self.hq * self.d))
