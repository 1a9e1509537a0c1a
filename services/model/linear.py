"""The model's linear layer: `nn.Linear` with a CPU bf16 inference path through a packed weight.

torch's bf16 matmul on CPU (oneDNN underneath) takes the weight in its plain layout on every
call. oneDNN's own linear, given the weight reordered once into its blocked layout (what
torch.compile's freezing does for CPU), gives the same results bit for bit (tests/test_linear)
and costs less the fewer the rows: most at the decode step's shapes, little at a prefill's
thousands of rows (docs/engineering-notes.md 3d).

`WeightPack` holds that reordered copy of one weight: made on first use, made again when the
weight changes (its storage, dtype or in-place version: `load_state_dict`, an optimizer step,
`.to()`), and never copied (a deep copy or pickle of the module starts without it). The path
is taken only where it is exact and pays: a bf16 weight and input on a CPU that multiplies
bf16 natively, with oneDNN, and no autograd; everywhere else `F.linear`, which stays the
reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.model.precision import cpu_has_native_bf16

# The row count oneDNN is told to expect when it lays the weight out (a hint: any count works).
_ROWS_HINT = 32


@functools.cache
def packing_available() -> bool:
    """oneDNN is built in, the CPU has native bf16 dot products, and torch's packed-linear ops
    (private to torch, so checked rather than assumed) exist and agree with `F.linear`."""
    if not (torch.backends.mkldnn.is_available() and cpu_has_native_bf16()):
        return False
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=generator).to(torch.bfloat16)
    x = torch.randn(3, 40, generator=generator).to(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return isinstance(out, Tensor) and torch.equal(out, F.linear(x, w))


class WeightPack:
    """oneDNN's reordered copy of one bf16 weight, for `linear` calls without autograd."""

    __slots__ = ("_key", "_packed")

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype] | None = None
        self._packed: Tensor | None = None

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x, weight, bias), through the packed weight where that path applies."""
        if not self._applies(x, weight, bias):
            return F.linear(x, weight, bias)
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, self._get(weight), bias, "none", [],
                                                         "")
        return out

    @staticmethod
    def _applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
        if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
            return False
        if weight.device.type != "cpu" or x.device.type != "cpu" or x.numel() == 0:
            return False
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return False
        if bias is not None and bias.dtype != torch.bfloat16:
            return False
        return packing_available()

    def _get(self, weight: Tensor) -> Tensor:
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._packed is None or key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
            self._key = key
        return self._packed

    def __reduce__(self) -> tuple[type[WeightPack], tuple[()]]:
        return (WeightPack, ())


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict keys) with `WeightPack`'s path."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.pack = WeightPack()

    def forward(self, x: Tensor) -> Tensor:
        return self.pack.linear(x, self.weight, self.bias)
