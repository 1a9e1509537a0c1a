"""Waiting on the wall clock for a live mesh (processes) to reach a state: bounded polls
(not a test module)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(done: Callable[[], bool], what: str, polls: int = 300) -> None:
    """Polls `done` every 0.1 s, at most `polls` times (a bound, not a pace)."""
    for _ in range(polls):
        if done():
            return
        time.sleep(0.1)
    raise AssertionError(f"never {what}")
