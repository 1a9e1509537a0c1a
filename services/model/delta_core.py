"""The part KDA and Gated DeltaNet share: q/k/v through short convolutions, the delta rule
run against a request's `LinearState`, and state snapshots at block boundaries.

Kimi Linear section 4 / Gated DeltaNet section 3.4 (docs/paper-notes.md 6.1, 6.3): q, k, v = SiLU(
ShortConv(W x)), q and k L2-normalised per head, beta = sigmoid(W_b x). The layers add their
own decay (per channel for KDA, per head for GDN) and output norm and gate.

Prefill uses the chunked kernel with chunk = block size; when snapshots are wanted and the
prefill does not start on a block boundary, the tokens up to the next boundary run as a
separate call so every later chunk ends exactly on a block boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.model.cache import LinearState
from services.model.config import ModelConfig
from services.model.conv import causal_conv1d, causal_conv1d_step
from services.model.delta_rule import delta_rule_chunked, delta_rule_step, delta_rule_step_
from services.model.delta_rule_train import delta_rule_trainable
from services.model.linear import Linear


def l2_normalise(x: Tensor, eps: float = 1e-6) -> Tensor:
    return F.normalize(x.float(), dim=-1, eps=eps).to(x.dtype)


def inverse_softplus(y: Tensor) -> Tensor:
    return y + torch.log(-torch.expm1(-y))


def init_decay_params(a_log: Tensor, dt_bias: Tensor, generator: torch.Generator) -> None:
    """A in [1, 16] and softplus(dt_bias) in [1e-3, 1e-1], log-uniform (Mamba-2's ranges)."""
    with torch.no_grad():
        a_log.copy_(torch.empty_like(a_log).uniform_(1.0, 16.0, generator=generator).log())
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.empty_like(dt_bias).uniform_(lo, hi, generator=generator).exp()
        dt_bias.copy_(inverse_softplus(dt))


def decay(a_log: Tensor, raw: Tensor, dt_bias: Tensor) -> Tensor:
    """g = -exp(A_log) * softplus(raw + dt_bias) in fp32; a_log broadcasts against raw."""
    return -a_log.float().exp() * F.softplus(raw.float() + dt_bias.float())


class DeltaMixer(nn.Module):
    """A delta-rule mixer layer (KDA, Gated DeltaNet): its own decay into the shared
    `DeltaCore`, the core's output through its own gated norm. A layer builds `core`,
    `a_log` and `dt_bias` and says `_decay` and `_output`."""

    core: DeltaCore
    a_log: nn.Parameter
    dt_bias: nn.Parameter

    def init_special(self, generator: torch.Generator) -> None:
        init_decay_params(self.a_log, self.dt_bias, generator)

    def forward(self, x: Tensor, cache: LinearState | None = None, pos0: int = 0,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, list[LinearState]]:
        """x [B, T, C] -> ([B, T, C], one LinearState per snapshot length)."""
        g = self._decay(x)  # [B, T, H, Dk or 1]
        o, snaps = self.core(x, g.transpose(1, 2), cache, pos0, snapshot_at)  # [B, T, H, D]
        return self._output(x, o), snaps

    def _decay(self, x: Tensor) -> Tensor:
        """x [B, T, C] -> log-decay g [B, T, H, Dk or 1] fp32."""
        raise NotImplementedError

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """o [B, T, H, D] -> [B, T, C]."""
        raise NotImplementedError


class DeltaCore(nn.Module):
    """Fused q/k/v projection, depthwise causal conv + SiLU, L2 norm, beta, the kernel."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.linear_heads, cfg.linear_head_dim
        self.block_size = cfg.block_size
        self.k1 = cfg.conv_size - 1
        inner = self.heads * self.head_dim
        self.qkv = Linear(cfg.d_model, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(3 * inner, cfg.conv_size))  # [C, K]
        self.beta_proj = Linear(cfg.d_model, self.heads, bias=False)

    def forward(self, x: Tensor, g: Tensor, cache: LinearState | None, pos0: int,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, list[LinearState]]:
        """x [B, T, C]; g [B, H, T, Dk or 1] log-decay -> (o [B, T, H, D], snapshots).

        With a cache, its state and conv tail are read and updated in place (copy_), so a
        decode batch's views stay valid; `pos0` is the cache length (for snapshots only).
        """
        b, t, _ = x.shape
        projected = self.qkv(x)  # [B, T, 3HD]
        tail = None if cache is None else cache.conv_tail
        conv_out, new_tail = causal_conv1d(projected, self.conv_weight, tail)
        q, k, v = F.silu(conv_out).view(b, t, 3, self.heads, self.head_dim).unbind(2)
        q, k = l2_normalise(q), l2_normalise(k)  # [B, T, H, D]
        beta = torch.sigmoid(self.beta_proj(x).float()).transpose(1, 2)  # [B, H, T]
        state = None if cache is None else cache.state
        o, final, states = run_delta_rule(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g, beta, state,
            pos0, self.block_size, snapshot_at, matmul_dtype=v.dtype,
        )
        snaps = [LinearState(states[n].clone(), conv_tail_at(projected, tail, pos0, n, self.k1))
                 for n in snapshot_at]
        if cache is not None:
            cache.state.copy_(final)
            cache.conv_tail.copy_(new_tail)
        return o.transpose(1, 2), snaps

    def decode(self, x: Tensor, g: Tensor, cache: LinearState) -> Tensor:
        """One token per request: x [B, 1, C], g [B, H, Dk or 1] -> o [B, 1, H, D].

        The lean path of `forward` with T == 1 (tested equal to it): the conv's one-token
        step, and the delta rule updating the batch's state buffer in place, with no
        chunking, snapshots or state copies.
        """
        b = x.shape[0]
        projected = self.qkv(x[:, 0])  # [B, 3HD]
        conv_out, window = causal_conv1d_step(projected, self.conv_weight, cache.conv_tail)
        cache.conv_tail.copy_(window)
        qkv = F.silu(conv_out).view(b, 3, self.heads, self.head_dim)
        # q and k normalised in one call (per head, as in `forward`).
        q, k = l2_normalise(qkv[:, :2]).unbind(1)  # [B, H, D]
        beta = torch.sigmoid(self.beta_proj(x[:, 0]).float())  # [B, H]
        v = qkv[:, 2]
        return delta_rule_step_(q, k, v, g, beta, cache.state)[:, None]


def conv_tail_at(projected: Tensor, tail: Tensor | None, pos0: int, boundary: int,
                 k_minus_1: int) -> Tensor:
    """The K - 1 conv inputs just before `boundary`: [B, K-1, C] (zeros before position 0)."""
    if tail is None:
        tail = projected.new_zeros(projected.shape[0], k_minus_1, projected.shape[2])
    joined = torch.cat((tail, projected), dim=1)  # index j is position pos0 - (K-1) + j
    start = boundary - pos0
    return joined[:, start : start + k_minus_1].clone()


def run_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   state: Tensor | None, pos0: int, block: int,
                   snapshot_at: Sequence[int], matmul_dtype: torch.dtype = torch.float32,
                   ) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
    """The kernel over q, k [B, H, T, Dk], v [B, H, T, Dv] starting at position pos0;
    `matmul_dtype` as in `delta_rule_chunked` (the serving path passes the model dtype).

    Returns (o [B, H, T, Dv], final state, {boundary: state}) for each requested boundary.
    """
    t = q.shape[2]
    if torch.is_grad_enabled() and q.requires_grad:
        # Training: the serving kernel's backward can overflow on steep decays.
        with torch.autocast(q.device.type, enabled=False):
            o, final = delta_rule_trainable(q, k, v, g, beta, state)
        return o, final, {}
    if not snapshot_at:
        if t == 1:
            o, final = delta_rule_step(q, k, v, g, beta, state)
        else:
            o, final = delta_rule_chunked(q, k, v, g, beta, state, chunk_size=block,
                                          matmul_dtype=matmul_dtype)
        return o, final, {}
    head = min(-pos0 % block, t)
    states: dict[int, Tensor] = {}
    outputs = []
    if head:
        o, state = delta_rule_chunked(q[:, :, :head], k[:, :, :head], v[:, :, :head],
                                      g[:, :, :head], beta[:, :, :head], state, chunk_size=block,
                                      matmul_dtype=matmul_dtype)
        outputs.append(o)
        states[pos0 + head] = state
    if head < t:
        o, state, ends = delta_rule_chunked(
            q[:, :, head:], k[:, :, head:], v[:, :, head:], g[:, :, head:], beta[:, :, head:],
            state, chunk_size=block, return_chunk_states=True, matmul_dtype=matmul_dtype,
        )
        outputs.append(o)
        for i in range(ends.shape[2]):
            states[pos0 + head + (i + 1) * block] = ends[:, :, i]
    if state is None:
        raise ValueError(f"run_delta_rule needs T >= 1, got T={t}")
    return torch.cat(outputs, dim=2), state, {n: states[n] for n in snapshot_at}
