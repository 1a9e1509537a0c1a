"""Which floating-point type the model serves in: bfloat16 where the hardware has it, else fp32.

On CPUs with native bf16 dot products (AVX512-BF16 or AMX) a bf16 matmul runs several times
faster than fp32 (benchmarks/bench_model.py; docs/engineering-notes.md 3d); without them
PyTorch emulates bf16 and it is slower than fp32. On CUDA, bf16 needs compute capability 8.0
or newer. The choice is made once, at start: `resolve_dtype("auto")`.

Whatever the model dtype, the linear-attention recurrent states stay fp32 (the delta-rule
kernels' contract), and so do logits, norms' statistics and softmax sums.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from services.model.config import ModelConfigError

DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16")
# /proc/cpuinfo flags meaning the CPU multiplies bf16 natively (not emulated through fp32).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo does not exist)."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return bool(_BF16_FLAGS & cpu_flags())


def serving_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where `device` computes it natively, float32 elsewhere."""
    dev = torch.device(device)
    if dev.type == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    elif dev.type == "cpu":
        native = cpu_has_native_bf16()
    else:
        native = False
    return torch.bfloat16 if native else torch.float32


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """"auto" -> the `serving_dtype` of the device by name; "float32" and "bfloat16" as they
    are (an explicit bfloat16 is honoured even where it is emulated: tests use it)."""
    if name not in DTYPE_CHOICES:
        raise ModelConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {name!r}")
    if name != "auto":
        return name
    return "bfloat16" if serving_dtype(device) == torch.bfloat16 else "float32"
