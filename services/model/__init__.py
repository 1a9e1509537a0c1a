"""The hybrid model engine: configs, layers, the LM, its request cache, KV export and generation.

Modules: `config` (families, sizes, KV byte accounting, FLOPs; torch-free), the layers
(`kda`, `gated_deltanet` over `delta_core`; `mla`, `gqa`, `swa` over `attention`; `ffn`,
`norm`, `rope`), `model` (the LM, `build_model`), `cache` (per-request KV, state
snapshots), `export` (the wire format of KV pieces, import), `generate` (prefill,
one-request generation), `batch` (continuous-batching decode), `sampling`, `kv_replay`
(decode from exported KV in another process), `precision` (the serving dtype). The package
root imports nothing at import time, so light modules (the tokenizer, the config) stay cheap
to import; `serving_dtype` imports torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def serving_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where `device` computes it natively, else float32 (see `precision`)."""
    from services.model.precision import serving_dtype as pick

    return pick(device)
