"""The workers' tests' prompts: `n` byte tokens (1 to 500) in a fixed pattern that `salt`
shifts, so prompts of one salt share their prefixes and of two salts do not (not a test
module)."""

from __future__ import annotations


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13) % 500 + 1 for i in range(n)]
