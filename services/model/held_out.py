"""The shipped checkpoint's loss measured again, on a fixed slice of the held-out text.

`prfaas train` records the loss over the whole held-out last 10% of the corpus
(services/model/train.py). `make bench-model` measures it again on `held_out_slice`: the last
HELD_OUT_SLICE_CHARS characters, inside that 10%, which the checkpoint never trained on. The
suite (tests/test_train.py) scores every 8th window of the same slice, an eighth of the work;
on the shipped checkpoint (float32) the whole slice sits 0.8 % above the recorded 1.533
nats/char and the eighth 1.3 % above it, both well inside the test's 3 %.
"""

from __future__ import annotations

import torch
from torch import nn

from services.model.tokenizer import TokenizerLike
from services.model.train import evaluate

HELD_OUT_SLICE_CHARS = 100_000


def held_out_slice(text: str, val_fraction: float = 0.1) -> str:
    """The last HELD_OUT_SLICE_CHARS characters of the corpus; refused when they would reach
    into the training part (a corpus under 1,000,000 characters at the default 10%)."""
    if int(len(text) * val_fraction) < HELD_OUT_SLICE_CHARS:
        raise ValueError(f"a corpus of {len(text):,} characters holds out fewer than "
                         f"{HELD_OUT_SLICE_CHARS:,} (val_fraction={val_fraction})")
    return text[-HELD_OUT_SLICE_CHARS:]


def held_out_nats_per_char(model: nn.Module, text: str, tokenizer: TokenizerLike,
                           seq_len: int = 256, stride: int = 1) -> float:
    """Next-token loss per character of `text` (non-overlapping windows of seq_len tokens, every
    `stride`-th, as `evaluate`), run in the model's own dtype: what the model scores as served.
    Per character over the whole text's tokens per character, whatever the stride."""
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    return evaluate(model, ids, seq_len, stride=stride) * ids.numel() / len(text)
