"""The gated delta rule: the linear-attention recurrence of KDA and Gated DeltaNet layers.

Per head, with state S in R^{Dk x Dv} and for every token t (docs/paper-notes.md section 6.1,
following
flash-linear-attention's naive KDA reference):

    S <- Diag(exp(g_t)) S                      decay the Dk rows (per channel for KDA,
                                               one scalar per head for Gated DeltaNet)
    S <- S + beta_t k_t (v_t - S^T k_t)^T      delta-rule write
    o_t = S^T (q_t * scale)                    scale defaults to Dk ** -0.5

Three entry points compute it: `delta_rule_reference` (token by token, the obvious loop),
`delta_rule_step` (one decode token) and `delta_rule_chunked` (prefill, matmul-bound).

The chunked form (WY / UT transform, as in the Gated DeltaNet paper, arXiv 2412.06464, and
fla's chunk kernels). Inside a chunk of C tokens starting from state S0, let G_i be the
cumulative log-decay from the chunk start through token i (inclusive). Writing
S_i = Diag(exp(G_i)) (S0 + sum_{j<=i} Diag(exp(-G_j)) k_j u_j^T), the pseudo-values u solve
the unit lower-triangular system

    (I + A) U = Diag(beta) (V - (K * exp(G)) S0),  A_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)

for j < i, so U = U' - W S0 with [W | U'] = (I + A)^-1 Diag(beta) [K * exp(G) | V]; outputs
are O = (Q * exp(G)) S0 + P U with P_ij = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, and the
chunk's end state is Diag(exp(G_C)) S0 + (K * exp(G_C - G))^T U. Only that last line runs
sequentially over chunks; everything else is batched over [B, H, chunks].

Per-channel decays make A and P more than a masked matmul: exp(G_i - G_j) must be split into
a row factor and a column factor, and exp(-G_j) alone overflows fp32 once a chunk decays by
more than about e^-88. The split is taken around the per-channel midpoint of G, which is exact
while a block's decay spans at most e^-160. Steeper blocks are halved (the "secondary
chunking" of the Kimi Linear paper, section 3.2): rows in the second half against columns in
the first are one matmul of (x_i * exp(G_i - G_r)) and (y_j * exp(G_r - G_j)), with r the last
token of the first half, so both exponents are <= 0; each half then starts over, so only
blocks that are still too steep split further (a single token never is).
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from services.model.config import ModelError
from services.model.decay_products import decayed_products_channel, decayed_products_scalar
from services.model.triangular import unit_lower_inverse

DEFAULT_CHUNK_SIZE = 64
# The intra-chunk work runs on groups of chunks whose C x C fp32 products take this many
# bytes (96 chunks of 64 x 64): a group's dozen intermediates stay in the caches instead of
# each elementwise pass streaming all chunks through memory (kimi-linear prefill at 4K in
# bf16, 2 threads: 9-13% faster than one group of 384 chunks, at 16K 10-12%; groups of
# 12 chunks: no gain).
_GROUP_BYTES = 96 * 64 * 64 * 4


class DeltaRuleError(ModelError, ValueError):
    """An argument of a delta-rule kernel has the wrong shape or value."""


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> None:
    if q.dim() != 4:
        raise DeltaRuleError(f"q must be [B, H, T, Dk], got shape {tuple(q.shape)}")
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    expected = {
        "k": (k, (b, h, t, dk)),
        "v": (v, (b, h, t, dv)),
        "beta": (beta, (b, h, t)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise DeltaRuleError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if tuple(g.shape) not in ((b, h, t, dk), (b, h, t, 1)):
        raise DeltaRuleError(
            f"g must have shape {(b, h, t, dk)} or {(b, h, t, 1)}, got {tuple(g.shape)}"
        )
    if state is not None and tuple(state.shape) != (b, h, dk, dv):
        raise DeltaRuleError(f"state must have shape {(b, h, dk, dv)}, got {tuple(state.shape)}")


def _initial_state(state: Tensor | None, q: Tensor, dv: int) -> Tensor:
    if state is None:
        b, h, _, dk = q.shape
        return torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
    return state.to(torch.float32)


def _scale(scale: float | None, dk: int) -> float:
    return dk**-0.5 if scale is None else scale


def _recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor
) -> tuple[Tensor, Tensor]:
    """One token in fp32. q, k, g: [B, H, Dk] (g may be [B, H, 1]); v: [B, H, Dv]; beta: [B, H]."""
    s = s * g.exp()[..., None]  # [B, H, Dk, Dv]
    residual = v - (k[..., None, :] @ s)[..., 0, :]  # [B, H, Dv]
    s = s + (beta[..., None] * k)[..., None] * residual[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


def delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule.

    q, k: [B, H, T, Dk] (L2-normalised by the caller); v: [B, H, T, Dv]; g: [B, H, T, Dk]
    per-channel log-decay (KDA) or [B, H, T, 1] per-head (Gated DeltaNet); beta: [B, H, T];
    state: [B, H, Dk, Dv] or None for zeros. Returns (o [B, H, T, Dv] in v's dtype, final
    state [B, H, Dk, Dv] fp32).
    """
    _check_inputs(q, k, v, g, beta, state)
    s = _initial_state(state, q, v.shape[-1])
    qf = q.float() * _scale(scale, q.shape[-1])
    kf, vf, gf, bf = k.float(), v.float(), g.float(), beta.float()
    outputs = []
    for t in range(q.shape[2]):
        o, s = _recurrent_step(qf[:, :, t], kf[:, :, t], vf[:, :, t], gf[:, :, t], bf[:, :, t], s)
        outputs.append(o)
    o_all = torch.stack(outputs, dim=2) if outputs else vf.new_zeros(vf.shape)
    return o_all.to(v.dtype), s


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode step: shapes as `delta_rule_reference` with T == 1. Batched over B."""
    _check_inputs(q, k, v, g, beta, state)
    if q.shape[2] != 1:
        raise DeltaRuleError(f"delta_rule_step takes T == 1, got T={q.shape[2]}")
    s = _initial_state(state, q, v.shape[-1])
    qf = q[:, :, 0].float() * _scale(scale, q.shape[-1])
    o, s = _recurrent_step(
        qf, k[:, :, 0].float(), v[:, :, 0].float(), g[:, :, 0].float(), beta[:, :, 0].float(), s
    )
    return o[:, :, None].to(v.dtype), s


def delta_rule_step_(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
    scale: float | None = None,
) -> Tensor:
    """One decode token for B requests, updating `state` in place (a decode batch's buffer):
    no new state tensor, no copy back. q, k, g [B, H, Dk] (g may be [B, H, 1]); v [B, H, Dv];
    beta [B, H]; state [B, H, Dk, Dv] fp32 contiguous -> o [B, H, Dv] in v's dtype.

    Same maths as `delta_rule_step`; the rank-1 write is one broadcast multiply-add into the
    state (4 passes over it instead of 8, which at batch 32 is most of a KDA layer's decode
    time). addcmul_ rather than baddbmm_ with an inner dimension of 1: same products and
    sums, 40% less time on CPU. k and q stay two matmuls: one with both rows costs as much.
    """
    b, h, dk, dv = state.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise DeltaRuleError(f"state must be contiguous fp32, got {state.dtype}")
    _check_inputs(q[:, :, None], k[:, :, None], v[:, :, None], g[:, :, None],
                  beta[:, :, None], state)
    flat = state.view(b * h, dk, dv)
    flat.mul_(g.float().exp().view(b * h, -1, 1))
    kf = k.float().reshape(b * h, 1, dk)
    residual = v.float().reshape(b * h, 1, dv) - torch.bmm(kf, flat)  # [BH, 1, Dv]
    written = (kf * beta.float().reshape(b * h, 1, 1)).transpose(1, 2)  # [BH, Dk, 1]
    flat.addcmul_(written, residual)
    qf = q.float().reshape(b * h, 1, dk) * _scale(scale, dk)
    return torch.bmm(qf, flat).view(b, h, dv).to(v.dtype)


def _to_chunks(x: Tensor, chunk: int, dtype: torch.dtype | None = None) -> Tensor:
    """[B, H, T, D] (any strides) -> [N*B*H, C, D] in dtype (x's by default), chunk-major
    (chunk n of every head, then chunk n + 1), zero-padding T up to N*C. One copy."""
    b, h, t, d = x.shape
    n, full = -(-t // chunk), t // chunk
    out = torch.empty(n, b, h, chunk, d, dtype=dtype or x.dtype, device=x.device)
    by_chunk = x[:, :, : full * chunk].unflatten(2, (full, chunk))  # [B, H, full, C, D]
    out[:full].copy_(by_chunk.permute(2, 0, 1, 3, 4))
    if full < n:
        rest = t - full * chunk
        out[full, :, :, :rest].copy_(x[:, :, full * chunk :])
        out[full, :, :, rest:].zero_()
    return out.view(n * b * h, chunk, d)


def _from_chunks(
    o: Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype, scale: float
) -> Tensor:
    """Chunk-major o [N*B*H, C, D] -> [B, H, T, D] in dtype, times scale. One copy."""
    b, h, t, d = shape
    chunk = o.shape[1]
    n = o.shape[0] // (b * h)
    by_chunk = o.view(n, b, h, chunk, d).permute(1, 2, 0, 3, 4)
    out = torch.empty(b, h, n * chunk, d, dtype=dtype, device=o.device)
    torch.mul(by_chunk, scale, out=out.view(b, h, n, chunk, d))
    return out if n * chunk == t else out[:, :, :t].contiguous()


IntraParts = tuple[Tensor, Tensor, Tensor, Tensor]


def _intra_chunk(
    q: Tensor, k: Tensor, v: Tensor, gcum: Tensor, beta: Tensor, matmul_dtype: torch.dtype,
    out: IntraParts,
) -> None:
    """Per-chunk pieces, all chunks at once. q, k: [M, C, Dk]; v: [M, C, Dv];
    gcum: [M, C, Dk or 1]; beta: [M, C, 1].

    Writes out = (q_state [M, C, Dk], o_local [M, C, Dv], transition [M, Dk, Dk],
    inject [M, Dk, Dv]) such that o = o_local + q_state @ S0 (unscaled) and the end state
    is transition @ S0 + inject. Every elementwise step writes its result where it is next
    read (in the matmul dtype where a matmul reads it), so no pass is spent on a copy.
    """
    m, c, dk = k.shape
    dv, low = v.shape[-1], matmul_dtype
    q_state, o_local, transition, inject = out
    rows = k.new_empty(m, 2, c, dk, dtype=torch.float32)  # [kb | q], the decayed products'
    kb = torch.mul(k, beta, out=rows[:, 0])
    rows[:, 1].copy_(q)
    products = decayed_products_scalar if gcum.shape[-1] == 1 else decayed_products_channel
    r = products(rows, k, gcum)  # [M, 2, C, C]: A, P, valid on and below the diagonal
    decay_in = gcum.exp()  # [M, C, Dk or 1], from the chunk start, <= 1
    rhs = k.new_empty(m, c, dk + dv, dtype=low)
    torch.mul(kb, decay_in, out=rhs[..., :dk])
    torch.mul(v, beta, out=rhs[..., dk:])
    # The inverse reads only A's strictly lower triangle; P is masked after its conversion
    # (tril of the strided fp32 view costs 20x the conversion).
    solved = unit_lower_inverse(r[:, 0]).to(low) @ rhs  # [M, C, Dk + Dv], [W | U']
    p_solved = r[:, 1].to(low).tril_() @ solved  # [M, C, Dk + Dv]
    g_last = gcum[:, -1:]  # [M, 1, Dk or 1]
    k_end_t = k.new_empty(m, dk, c, dtype=low)  # k decayed to the chunk end, transposed
    torch.mul(k.mT, (g_last - gcum).exp_().mT, out=k_end_t)
    end_solved = k_end_t @ solved  # [M, Dk, Dk + Dv]
    torch.mul(q, decay_in, out=q_state).sub_(p_solved[..., :dk])
    o_local.copy_(p_solved[..., dk:])
    torch.mul(end_solved[..., :dk], -1.0, out=transition)
    transition.diagonal(dim1=-2, dim2=-1).add_(g_last[:, 0].exp())
    inject.copy_(end_solved[..., dk:])


def _intra_chunks(
    q: Tensor, k: Tensor, v: Tensor, gcum: Tensor, beta: Tensor, matmul_dtype: torch.dtype,
) -> IntraParts:
    """`_intra_chunk` over all chunks, a group of them at a time (_GROUP_BYTES); the chunks
    are independent, so the result is the same as in one call."""
    m, c, dk = k.shape
    dv = v.shape[-1]
    group = max(1, _GROUP_BYTES // (c * c * 4))
    f32 = torch.float32
    outs = (k.new_empty(m, c, dk, dtype=f32), k.new_empty(m, c, dv, dtype=f32),
            k.new_empty(m, dk, dk, dtype=f32), k.new_empty(m, dk, dv, dtype=f32))
    for lo in range(0, m, group):
        hi = lo + group
        _intra_chunk(q[lo:hi], k[lo:hi], v[lo:hi], gcum[lo:hi], beta[lo:hi], matmul_dtype,
                     (outs[0][lo:hi], outs[1][lo:hi], outs[2][lo:hi], outs[3][lo:hi]))
    return outs


def _pass_states(transition: Tensor, inject: Tensor, s0: Tensor) -> Tensor:
    """The only sequential part. transition [N, BH, Dk, Dk], inject [N, BH, Dk, Dv],
    s0 [BH, Dk, Dv] -> states at every chunk boundary [N + 1, BH, Dk, Dv]."""
    n = transition.shape[0]
    states = s0.new_empty(n + 1, *s0.shape)
    states[0] = s0
    states[1:] = inject  # one copy, not one inside each baddbmm below
    for i in range(n):
        states[i + 1].baddbmm_(transition[i], states[i])
    return states


@overload
def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = ...,
    scale: float | None = ...,
    chunk_size: int = ...,
    return_chunk_states: Literal[False] = ...,
    *,
    matmul_dtype: torch.dtype = ...,
) -> tuple[Tensor, Tensor]: ...


@overload
def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = ...,
    scale: float | None = ...,
    chunk_size: int = ...,
    *,
    return_chunk_states: Literal[True],
    matmul_dtype: torch.dtype = ...,
) -> tuple[Tensor, Tensor, Tensor]: ...


def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_chunk_states: bool = False,
    *,
    matmul_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Chunk-parallel gated delta rule for prefill; same maths as `delta_rule_reference`.

    Any T >= 1 (the last chunk is zero-padded internally). chunk_size must be a power of two.
    With return_chunk_states, a third value holds the state after each full chunk:
    [B, H, T // chunk_size, Dk, Dv] fp32 (the snapshots prefix caching keeps at block ends).

    matmul_dtype: fp32 (default) runs every product in fp32. bfloat16 (the serving path of a
    bf16 model) runs the three largest intra-chunk products, the solve's right-hand side and
    the outputs and state updates from it, as bf16 matmuls with fp32 accumulation (as fla's
    chunk kernels do); the decayed key products, the triangular inverse and the recurrent
    states stay fp32. About 3x faster products, at bf16 rounding of their results.

    Inference only: it writes into preallocated buffers, which autograd cannot follow.
    Training runs `delta_rule_train.delta_rule_trainable` (same maths, plain ops).
    """
    _check_inputs(q, k, v, g, beta, state)
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, state)
    ):
        raise DeltaRuleError(
            "delta_rule_chunked has no backward; train through delta_rule_trainable"
        )
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise DeltaRuleError(f"chunk_size must be a power of two, got {chunk_size}")
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    n = -(-t // chunk_size)
    s0 = _initial_state(state, q, dv).reshape(b * h, dk, dv)
    # q, k, v keep their dtype (bf16 from a bf16 model): every step that reads them computes
    # in fp32 by type promotion, so converting them here would only move twice the bytes.
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q, k, v))  # [M, C, D], M = N*B*H
    # Padded tokens have g = 0, beta = 0 and k = 0: they leave the state untouched.
    gcum = _to_chunks(g, chunk_size, torch.float32).cumsum_(dim=1)
    q_state, o_local, transition, inject = _intra_chunks(
        qc, kc, vc, gcum, _to_chunks(beta[..., None], chunk_size, torch.float32), matmul_dtype
    )
    states = _pass_states(
        transition.view(n, b * h, dk, dk), inject.view(n, b * h, dk, dv), s0
    )  # [N + 1, BH, Dk, Dv]
    o = torch.baddbmm(o_local, q_state, states[:n].view(-1, dk, dv))  # [M, C, Dv]
    o = _from_chunks(o, (b, h, t, dv), v.dtype, _scale(scale, dk))
    final = states[n].view(b, h, dk, dv)
    if not return_chunk_states:
        return o, final
    ends = states[1 : t // chunk_size + 1].view(-1, b, h, dk, dv).permute(1, 2, 0, 3, 4)
    return o, final, ends.contiguous()
