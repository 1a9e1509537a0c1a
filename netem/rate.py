"""A sliding-window rate meter: bytes per second over the last `window_s` seconds.

The link's statistics report each direction's throughput with it (netem/shaper.py). Counts
go into fixed-width time buckets, so memory stays bounded however many chunks pass, and a
meter that started less than a window ago averages only over the time it has seen.
"""

from __future__ import annotations

import math
from collections import deque


class RateWindow:
    """Bytes per second over a sliding window, kept as fixed-width time buckets."""

    def __init__(self, window_s: float, buckets: int = 10) -> None:
        self._bucket_s = window_s / buckets
        self._buckets = buckets
        self._counts: deque[list[int]] = deque()
        self._first_sample = math.inf

    def add(self, now: float, nbytes: int) -> None:
        self._first_sample = min(self._first_sample, now)
        index = int(now // self._bucket_s)
        if self._counts and self._counts[-1][0] == index:
            self._counts[-1][1] += nbytes
            return
        self._counts.append([index, nbytes])
        while len(self._counts) > self._buckets + 1:
            self._counts.popleft()

    def rate(self, now: float) -> float:
        first = int(now // self._bucket_s) - self._buckets + 1
        total = sum(count for index, count in self._counts if index >= first)
        # Never average over time before the first sample (a link that just started).
        span = now - max(first * self._bucket_s, self._first_sample)
        return total / max(span, self._bucket_s)
