"""A tiny model config whose logits are decisive, and random prompts that never hold its
end-of-sequence token, for the tests that generate with it (not a test module)."""

from __future__ import annotations

import msgspec
import torch

from services.model.config import ModelConfig, family_config

EOS_ID = 511


def sharp(family: str) -> ModelConfig:
    """The family's tiny config with a larger init (errors show) and EOS_ID at the vocab's top."""
    return msgspec.structs.replace(family_config(family, "tiny"), init_std=0.1, eos_id=EOS_ID)


def tokens(n: int, seed: int) -> torch.Tensor:
    """`n` random tokens below EOS_ID (token 0 left out), from `seed`."""
    return torch.randint(1, EOS_ID, (n,), generator=torch.Generator().manual_seed(seed))
