"""The gated delta rule in plain differentiable ops: the training path of the linear layers.

The serving kernel (`delta_rule.delta_rule_chunked`) is built for inference: preallocated
`out=` buffers and decays factorised around each chunk's midpoint, whose backward can overflow
when a chunk decays steeply. Training takes this form instead (`delta_core` routes to it
whenever gradients flow); its values and gradients are tested against the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def delta_rule_trainable(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, scale: float | None = None, chunk: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule in plain differentiable ops, for training only.

    Same contract and maths (WY form) as `delta_rule.delta_rule_chunked`: q, k [B, H, T, Dk],
    v [B, H, T, Dv], g [B, H, T, Dk or 1], beta [B, H, T] -> (o [B, H, T, Dv], state fp32).
    The decay between tokens i >= j of a chunk is exp(G_i - G_j) taken directly, [C, C, Dg]
    per chunk, so no factor can overflow; a small chunk keeps that tensor cheap.
    """
    b, h, t, dk = q.shape
    n, pad = -(-t // chunk), -t % chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, ...] -> [B, H, N, C, ...]
        x = F.pad(x.float(), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.view(b, h, n, chunk, *x.shape[3:])

    qc = chunks(q) * (dk**-0.5 if scale is None else scale)
    kc, vc, bc = chunks(k), chunks(v), chunks(beta)[..., None]  # bc [B, H, N, C, 1]
    gcum = chunks(g).cumsum(dim=3)  # [B, H, N, C, Dg]
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()[..., None]  # j <= i
    diff = gcum[..., :, None, :] - gcum[..., None, :, :]  # [B, H, N, C_i, C_j, Dg]
    decay = diff.masked_fill(~lower, -math.inf).exp()
    if decay.shape[-1] == 1:
        a = (kc @ kc.transpose(-1, -2)) * decay[..., 0]  # [B, H, N, C, C]
        p = (qc @ kc.transpose(-1, -2)) * decay[..., 0]
    else:
        a = torch.einsum("...id,...ijd,...jd->...ij", kc, decay, kc)
        p = torch.einsum("...id,...ijd,...jd->...ij", qc, decay, kc)
    lhs = torch.eye(chunk) + (a * bc).tril(-1)
    rhs = torch.cat((kc * gcum.exp(), vc), dim=-1) * bc
    w_u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    w, u0 = w_u[..., :dk], w_u[..., dk:]
    q_in, g_end = qc * gcum.exp(), gcum[..., -1:, :]  # g_end [B, H, N, 1, Dg]
    k_out = kc * (g_end - gcum).exp()
    s = q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32) if state is None else state
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ s  # [B, H, C, Dv]
        outs.append(q_in[:, :, i] @ s + p[:, :, i] @ u)
        s = g_end[:, :, i, 0, :, None].exp() * s + k_out[:, :, i].transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :t].to(v.dtype), s
