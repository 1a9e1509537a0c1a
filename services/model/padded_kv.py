"""A decode batch's full-attention KV: every member's tokens in one zero-padded tensor.

The members of a `DecodeBatch` have different lengths, so their full-attention KV cannot be
one dense tensor without padding. `TokenSlots` owns, per full-attention layer, buffers
[slots, A, capacity, X] whose row s is the storage of the member in slot s: that member's
`TokenKV.buffers` are views of the row (as the batch's linear states are views of theirs), so
a decode step writes each new token in place and attends over all members with two batched
matmuls, with no per-step copy, conversion or allocation of the cached tokens. Leaving gives
the request its own copies back.

`PaddedKV` is what one step's attention layer sees: the rows of the current members and
their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.model.cache import CacheError, TokenKV


@dataclass(frozen=True)
class PaddedKV:
    """One layer's KV for a decode step: buffers [B, A, cap, X] (row i: member i's TokenKV
    storage), `lengths` [B] the tokens each member held before this step, `members` their
    TokenKVs (whose lengths the step advances)."""

    buffers: list[Tensor]
    lengths: Tensor
    members: list[TokenKV]

    def append(self, new: Sequence[Tensor]) -> list[Tensor]:
        """Write one token per member (new[j] [B, A, X] for buffer j) at its length; returns
        the whole rows [B, A, cap, X]. Not sliced to the longest member: CPU bf16 bmm copies
        an operand whose rows are not packed, which costs more than the padding it skips."""
        rows = torch.arange(len(self.members), device=self.lengths.device)
        for buffer, x in zip(self.buffers, new, strict=True):
            buffer[rows, :, self.lengths] = x
        for kv in self.members:
            kv.length += 1
        return self.buffers


class TokenSlots:
    """Storage of one full-attention layer for a decode batch: buffers [slots, A, cap, X],
    cap a whole number of blocks; a member's TokenKV buffers are views of its slot's row."""

    def __init__(self, shapes: Sequence[tuple[int, int]], slots: int, capacity: int,
                 block_size: int, dtype: torch.dtype) -> None:
        self.block_size = block_size
        blocks = max(1, -(-capacity // block_size))
        self.buffers = [torch.zeros(slots, a, blocks * block_size, x, dtype=dtype)
                        for a, x in shapes]

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def resized(self, slots: int, length: int) -> TokenSlots:
        """Empty storage for `slots` rows that fits `length` tokens, grown by at least a
        quarter when it must grow (amortised, as `TokenKV.reserve`)."""
        capacity = self.capacity
        if length > capacity:
            current = capacity // self.block_size
            capacity = max(length, (current + max(1, current // 4)) * self.block_size)
        shapes = [(b.shape[1], b.shape[3]) for b in self.buffers]
        return TokenSlots(shapes, slots, capacity, self.block_size, self.buffers[0].dtype)

    def shrunk(self, capacity: int) -> TokenSlots:
        """Empty storage of as many rows, `capacity` tokens each (rounded up to blocks)."""
        shapes = [(b.shape[1], b.shape[3]) for b in self.buffers]
        return TokenSlots(shapes, self.slots, capacity, self.block_size, self.buffers[0].dtype)

    def adopt(self, kv: TokenKV, slot: int) -> None:
        """Copy `kv`'s tokens into row `slot` (zeros after them) and make `kv` use that row."""
        if kv.length > self.capacity:
            raise CacheError(f"{kv.length} tokens do not fit a batch row of {self.capacity}")
        for buffer, own in zip(self.buffers, kv.buffers, strict=True):
            row = buffer[slot]
            if row.data_ptr() != own.data_ptr():
                row[:, : kv.length].copy_(own[:, : kv.length])
                # Padded keys are masked, but 0 * NaN in probs @ values would not be.
                row[:, kv.length :].zero_()
        kv.buffers = [buffer[slot] for buffer in self.buffers]

    def holds(self, kv: TokenKV, slot: int) -> bool:
        return all(own.data_ptr() == buffer[slot].data_ptr() and own.shape == buffer[slot].shape
                   for own, buffer in zip(kv.buffers, self.buffers, strict=True))

    def padded(self, members: list[TokenKV], lengths: Tensor) -> PaddedKV:
        """The first len(members) rows as one step's PaddedKV."""
        n = len(members)
        return PaddedKV([b[:n] for b in self.buffers], lengths, members)


def release(kv: TokenKV) -> None:
    """Give `kv` its own storage again (a copy of its tokens, in whole blocks)."""
    kv.buffers = kv.truncated(kv.length).buffers
