"""Decayed key products inside one chunk of the gated delta rule, without overflow.

R[i, j] = sum_d rows[i, d] cols[j, d] exp(G[i, d] - G[j, d]) for j <= i, G the cumulative
log-decay within the chunk: the one part of the chunked kernel (`delta_rule`) where per-channel
decays meet, factorised so that no exponent leaves fp32's range.
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp(80) and exp(-80) are well inside fp32's normal range (about e^-87 .. e^88).
_MAX_EXPONENT = 80.0


def decayed_products_channel(rows: Tensor, cols: Tensor, gcum: Tensor) -> Tensor:
    """R[m, x, i, j] = sum_d rows[m,x,i,d] cols[m,j,d] exp(G[m,i,d] - G[m,j,d]) for j <= i.

    rows [M, X, C, D], cols [M, C, D], gcum [M, C, D] cumulative log-decay -> [M, X, C, C];
    entries above the diagonal are unspecified (possibly inf): callers mask them. Blocks whose
    decay spans at most 2 * _MAX_EXPONENT take one matmul, the others are split.
    """
    high, low = gcum.amax(dim=1, keepdim=True), gcum.amin(dim=1, keepdim=True)  # [M, 1, D]
    steep = (high - low).amax(dim=-1)[:, 0] > 2 * _MAX_EXPONENT  # [M]
    if not steep.any():
        return centred_products(rows, cols, gcum, (high + low) * 0.5)
    r = rows.new_empty(*rows.shape[:3], rows.shape[2])
    gentle, steep_at = (~steep).nonzero()[:, 0], steep.nonzero()[:, 0]
    centre = (high[gentle] + low[gentle]) * 0.5
    r[gentle] = centred_products(rows[gentle], cols[gentle], gcum[gentle], centre)
    r[steep_at] = split_products(rows[steep_at], cols[steep_at], gcum[steep_at])
    return r


def centred_products(rows: Tensor, cols: Tensor, gcum: Tensor, centre: Tensor) -> Tensor:
    """One matmul with exp(G_i - G_j) = exp(G_i - c) exp(c - G_j), c [M, 1, D] the midpoint of
    G, so no factor exceeds exp(span / 2). Shapes as `decayed_products_channel`."""
    m, x, c, d = rows.shape
    centred = (gcum - centre).exp_()  # [M, C, D]
    row_scaled = rows * centred[:, None]  # [M, X, C, D]
    cols_t = (cols / centred).transpose(-1, -2)  # [M, D, C]
    return (row_scaled.view(m, x * c, d) @ cols_t).view(m, x, c, c)


def split_products(rows: Tensor, cols: Tensor, gcum: Tensor) -> Tensor:
    """As `decayed_products_channel` for any decay (C >= 2): the lower-left quarter in one
    matmul split at the boundary r = C/2 - 1, where exp(G_i - G_r) and exp(G_r - G_j) both
    have exponents <= 0; the two diagonal halves recursively, as one batch."""
    m, x, c, d = rows.shape
    b = c // 2
    r = rows.new_zeros(m, x, c, c)
    split = gcum[:, b - 1 : b]  # [M, 1, D]
    lower = rows[:, :, b:] * (gcum[:, b:] - split).exp()[:, None]  # [M, X, b, D]
    upper_t = (cols[:, :b] * (split - gcum[:, :b]).exp()).transpose(-1, -2)  # [M, D, b]
    r[:, :, b:, :b] = (lower.reshape(m, x * b, d) @ upper_t).view(m, x, b, b)
    halves = decayed_products_channel(
        torch.cat((rows[:, :, :b], rows[:, :, b:])),
        torch.cat((cols[:, :b], cols[:, b:])),
        torch.cat((gcum[:, :b], gcum[:, b:])),
    )  # [2M, X, b, b]
    r[:, :, :b, :b] = halves[:m]
    r[:, :, b:, b:] = halves[m:]
    return r


def decayed_products_scalar(rows: Tensor, cols: Tensor, gcum: Tensor) -> Tensor:
    """As `decayed_products_channel` for a per-head decay, gcum [M, C, 1]: a masked matmul."""
    m, x, c, d = rows.shape
    decay = (gcum - gcum.transpose(-1, -2)).clamp_(max=0.0).exp_()  # [M, C, C]
    r = rows.view(m, x * c, d) @ cols.to(rows.dtype).transpose(-1, -2)  # [M, X*C, C]
    return r.view(m, x, c, c) * decay[:, None]
