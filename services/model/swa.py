"""Sliding-window attention with learnable sinks (MiMo-V2-Flash's local layer, docs/paper-notes.md
6.2).

A query at position t sees the W previous tokens and itself (W = cfg.window = 128); the
request state is a ring of the last W tokens' K/V (after RoPE). One learnable sink logit per
query head joins the softmax denominator only, letting a head put little mass on its window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from services.model.attention import sliding_window_attention, window_decode_attention
from services.model.cache import CacheError, WindowKV
from services.model.config import ModelConfig
from services.model.gqa import RopeQKV
from services.model.linear import Linear


class SlidingWindowAttention(nn.Module):
    """One SWA mixer; its request state is a `WindowKV` ring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.d, self.window = cfg.n_heads, cfg.head_dim, cfg.window
        self.qkv = RopeQKV(cfg)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.swa_sinks else None
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cache: WindowKV | None = None, pos0: int = 0,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, list[WindowKV]]:
        """x [B, T, C] -> ([B, T, C], one WindowKV per snapshot length); the cache (B == 1)
        supplies the window before pos0 and is updated in place."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x, torch.arange(pos0, pos0 + t, device=x.device))
        if cache is not None:
            if b != 1:
                raise CacheError(f"SWA prefill with a cache takes B == 1, got B={b}")
            prev_k, prev_v = cache.chronological(pos0)  # [1, n, Hkv, D]
            k, v = torch.cat((prev_k, k), dim=1), torch.cat((prev_v, v), dim=1)
        prefix = k.shape[1] - t
        o = sliding_window_attention(q, k, v, self.window, self.sinks)  # [B, T, Hq, D]
        snaps = [self._window_at(k, v, prefix, pos0, n) for n in snapshot_at]
        if cache is not None:
            latest = self._window_at(k, v, prefix, pos0, pos0 + t)
            cache.k.copy_(latest.k)
            cache.v.copy_(latest.v)
        return self.o_proj(o.reshape(b, t, self.hq * self.d)), snaps

    def _window_at(self, k: Tensor, v: Tensor, prefix: int, pos0: int, end: int) -> WindowKV:
        """The ring at `end` from k, v [B, prefix + T, Hkv, D] (first key at pos0 - prefix)."""
        n = min(end, self.window)
        stop = end - pos0 + prefix
        return WindowKV.from_chronological(k[:, stop - n : stop], v[:, stop - n : stop], end,
                                           self.window)

    def decode(self, x: Tensor, cache: WindowKV, positions: Tensor) -> Tensor:
        """x [B, 1, C], positions [B]; the batched rings [B, W, Hkv, D] are updated in place."""
        b = x.shape[0]
        q, k, v = self.qkv(x, positions[:, None])  # [B, 1, H, D]
        o = window_decode_attention(q[:, 0], cache.k, cache.v, k[:, 0], v[:, 0], positions,
                                    self.sinks)
        rows, slots = torch.arange(b, device=x.device), positions % self.window
        cache.k[rows, slots] = k[:, 0]
        cache.v[rows, slots] = v[:, 0]
        out: Tensor = self.o_proj(o.reshape(b, 1, self.hq * self.d))
        return out
