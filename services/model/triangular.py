"""The inverse of a unit lower-triangular matrix, (I + A)^-1 for strictly lower A, batched:
the one solve inside each chunk of the chunked delta rule (services/model/delta_rule.py).

Small diagonal blocks are inverted by forward substitution, then merged by doubling, so the
work is matmuls.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Diagonal blocks of (I + A) this wide are inverted by substitution, then merged by doubling.
_INVERSE_BLOCK = 8


def _invert_small_blocks(a: Tensor) -> Tensor:
    """(I + A)^-1 for strictly lower A [N, b, b], by forward substitution over rows."""
    n, b, _ = a.shape
    t = torch.eye(b, dtype=a.dtype, device=a.device).expand(n, b, b).contiguous()
    for i in range(1, b):
        t[:, i, :i] = -(a[:, i : i + 1, :i] @ t[:, :i, :i])[:, 0]
    return t


def _pair_blocks(x: Tensor, block: int) -> Tensor:
    """View of x [..., C, C] as [..., 2, b, 2, b, C/2b]: the four b x b blocks of each
    aligned 2b x 2b square on the diagonal (torch.diagonal puts the square index last)."""
    *lead, c, _ = x.shape
    n = c // (2 * block)
    return torch.diagonal(x.view(*lead, n, 2, block, n, 2, block), dim1=-6, dim2=-3)


def unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + A)^-1 for A [M, C, C] of which only the strictly lower triangle is read (the rest
    may hold anything, inf included): small diagonal blocks by substitution, then doubling,
    merging [[T11, 0], [A21, T22]] with T21 = -T22 A21 T11. Matmul-bound, unlike a batched
    triangular solve on CPU (measured 2.5 ms against 8.5 ms at M=256, C=64). Inference only
    (in-place writes); the result is contiguous, in a's dtype, zero above the diagonal."""
    m, c, _ = a.shape
    block = min(c, _INVERSE_BLOCK)
    n = c // block
    # [M, b, b, C/b] views of the diagonal blocks of a and t.
    a_small = torch.diagonal(a.view(m, n, block, n, block), dim1=1, dim2=3)
    t = a.new_zeros(m, c, c)
    inverse = _invert_small_blocks(a_small.permute(0, 3, 1, 2).reshape(-1, block, block))
    torch.diagonal(t.view(m, n, block, n, block), dim1=1, dim2=3).copy_(
        inverse.view(m, n, block, block).permute(0, 2, 3, 1)
    )
    while block < c:
        a_pairs, t_pairs = _pair_blocks(a, block), _pair_blocks(t, block)
        t11 = t_pairs[:, 0, :, 0].permute(0, 3, 1, 2)  # [M, C/2b, b, b]
        t22 = t_pairs[:, 1, :, 1].permute(0, 3, 1, 2)
        a21 = a_pairs[:, 1, :, 0].permute(0, 3, 1, 2)
        t_pairs[:, 1, :, 0].copy_((-(t22 @ a21 @ t11)).permute(0, 2, 3, 1))
        block *= 2
    return t
