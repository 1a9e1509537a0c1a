"""Multi-head latent attention with NoPE (Kimi Linear's full-attention layer, docs/paper-notes.md
6.1).

Only the compressed latent c = RMSNorm(W_dkv x) (kv_lora_rank values) is cached per token;
K and V are up-projected from it. There is no rotary embedding at all. Prefill up-projects
the latents and uses SDPA; decode absorbs W_uk into the query and W_uv into the output, so
each step attends over the latents directly (the MQA form of MLA).
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
from services.model.norm import RMSNorm
from services.model.padded_kv import PaddedKV


class MLA(nn.Module):
    """One MLA mixer; its TokenKV holds the latent as [1, capacity, kv_lora_rank]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d, c, r = cfg.n_heads, cfg.head_dim, cfg.d_model, cfg.kv_lora_rank
        self.heads, self.head_dim, self.rank = h, d, r
        self.q_proj = Linear(c, h * d, bias=False)
        self.kv_down = Linear(c, r, bias=False)
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        self.k_up = Linear(r, h * d, bias=False)
        self.v_up = Linear(r, h * d, bias=False)
        self.o_proj = Linear(h * d, c, bias=False)

    def forward(self, x: Tensor, cache: TokenKV | None = None, pos0: int = 0,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, list[None]]:
        """x [B, T, C] -> [B, T, C]; with a cache (B == 1) the latents are appended to it."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        q = self.q_proj(x).view(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        latent = self.kv_norm(self.kv_down(x))  # [B, T, r]
        if cache is not None:
            if b != 1 or cache.length != pos0:
                raise CacheError(f"MLA prefill takes B == 1 at the cache length, got B={b}")
            cache.append([latent])
            latent = cache.views()[0]  # [1, L, r]
        length = latent.shape[1]
        k = self.k_up(latent).view(b, length, h, d).transpose(1, 2)  # [B, H, L, D]
        v = self.v_up(latent).view(b, length, h, d).transpose(1, 2)
        o = causal_attention(q, k, v)  # [B, H, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, h * d)), [None] * len(snapshot_at)

    def decode(self, x: Tensor, caches: Sequence[TokenKV] | PaddedKV) -> Tensor:
        """x [B, 1, C]; request i attends over its KV (its new latent appended first): a
        decode batch's PaddedKV, or caches[i] (the per-request reference path)."""
        b = x.shape[0]
        h, d, r = self.heads, self.head_dim, self.rank
        q = self.q_proj(x).view(b, h, d)
        latent = self.kv_norm(self.kv_down(x))  # [B, 1, r]
        q_latent = torch.einsum("bhd,hdr->bhr", q, self.k_up.weight.view(h, d, r))
        # One latent "head" [1, L, r] per request, shared by all query heads.
        if isinstance(caches, PaddedKV):
            latents = caches.append([latent])[0]  # [B, 1, Lmax, r]
            context = padded_decode_attention(q_latent, latents, None, caches.lengths + 1,
                                              scale=d**-0.5)  # [B, H, r]
        else:
            for i, kv in enumerate(caches):
                kv.append([latent[i : i + 1]])
            context = ragged_decode_attention(q_latent, [kv.views()[0] for kv in caches], None,
                                              scale=d**-0.5)
        o = torch.einsum("bhr,hvr->bhv", context, self.v_up.weight.view(h, d, r))
        out: Tensor = self.o_proj(o.reshape(b, 1, h * d))
        return out
