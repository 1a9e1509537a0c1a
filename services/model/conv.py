"""Short causal depthwise convolution with a carried tail (the ShortConv of KDA / Gated DeltaNet).

Each channel c is filtered on its own: y[t, c] = sum_{j<K} weight[c, j] * x[t - (K-1) + j, c],
where inputs before the start of the sequence come from `tail`, the last K-1 inputs of the
previous segment (zeros for a fresh sequence). Returning the new tail lets a prefill be split
anywhere (prefix reuse, chunked prefill, decode) with results identical to one pass. Kimi
Linear and Qwen3-Next use K = 4 without bias (docs/paper-notes.md section 6.1); activation is the
caller's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.config import ModelError


class ConvError(ModelError, ValueError):
    """An argument of the causal convolution has the wrong shape."""


def _check_inputs(x: Tensor, weight: Tensor, tail: Tensor | None) -> None:
    if x.dim() != 3:
        raise ConvError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    b, _, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        raise ConvError(f"weight must be [C={c}, K>=1], got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if tail is not None and tuple(tail.shape) != (b, k - 1, c):
        raise ConvError(f"tail must have shape {(b, k - 1, c)}, got {tuple(tail.shape)}")


def _accumulator(x: Tensor) -> torch.dtype:
    """Sums run in at least fp32 (bf16 inputs would round after every tap)."""
    return torch.promote_types(x.dtype, torch.float32)


def _conv_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the prefill convolution runs in. oneDNN's bf16 depthwise kernel accumulates in
    fp32 and rounds once, so bf16 inputs with bf16 weights (the serving case) run natively,
    with no fp32 copies of the [B, T, C] activations; other mixes go through fp32."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        return torch.bfloat16
    return _accumulator(x)


def _with_history(x: Tensor, weight: Tensor, tail: Tensor | None) -> Tensor:
    """x [B, T, C] preceded by the tail (or zeros): [B, K-1+T, C]."""
    b, _, c = x.shape
    if tail is None:
        tail = x.new_zeros(b, weight.shape[1] - 1, c)
    return torch.cat((tail.to(x.dtype), x), dim=1)


def causal_conv1d(x: Tensor, weight: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution. x [B, T, C], weight [C, K], tail [B, K-1, C] or None.

    Returns (y [B, T, C], new tail [B, K-1, C]: the last K-1 inputs, which reach into the
    old tail when T < K-1). Sums run in fp32 at least; y comes back in x's dtype.
    """
    _check_inputs(x, weight, tail)
    _, t, c = x.shape
    padded = _with_history(x, weight, tail)  # [B, K-1+T, C]
    if t == 0:
        return x.clone(), padded.clone()
    acc = _conv_dtype(x, weight)
    # [B, C, 1, K-1+T] with channels-last strides is the [B, T, C] memory as it is: oneDNN's
    # depthwise kernel reads it without a transpose (3x faster than K shifted multiply-adds).
    image = padded.to(acc).permute(0, 2, 1).unsqueeze(2)
    kernel = weight.to(acc).view(c, 1, 1, weight.shape[1])
    y = F.conv2d(image, kernel, groups=c)  # [B, C, 1, T]
    return y.squeeze(2).permute(0, 2, 1).contiguous().to(x.dtype), padded[:, t:].clone()


def causal_conv1d_reference(
    x: Tensor, weight: Tensor, tail: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Token-by-token loop with the same contract as `causal_conv1d`."""
    _check_inputs(x, weight, tail)
    window = _with_history(x[:, :0], weight, tail)  # [B, K-1, C]
    outputs = []
    for t in range(x.shape[1]):
        y, window = causal_conv1d_step(x[:, t], weight, window)
        outputs.append(y)
    y_all = torch.stack(outputs, dim=1) if outputs else x.new_zeros(x.shape)
    return y_all, window


def causal_conv1d_step(x: Tensor, weight: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
    """One decode token: x [B, C], tail [B, K-1, C] -> (y [B, C], new tail [B, K-1, C])."""
    if x.dim() != 2:
        raise ConvError(f"x must be [B, C] for a step, got shape {tuple(x.shape)}")
    _check_inputs(x[:, None], weight, tail)
    window = torch.cat((tail.to(x.dtype), x[:, None]), dim=1)  # [B, K, C]
    acc = _accumulator(x)
    # Both factors in the accumulator dtype and the weight contiguous: a bf16 x fp32 multiply
    # casts element by element, several times slower (same products, same sums).
    y = (window.to(acc) * weight.to(acc).t().contiguous()).sum(dim=1)  # [B, C]
    return y.to(x.dtype), window[:, 1:]
