"""A time-weighted exponential average: how the dynamic policy smooths what it samples
(link utilisation, queue depths) over a time constant, whatever the sampling period."""

from __future__ import annotations

import math


class Ewma:
    """Exponential average over a time constant `tau_s` on the caller's clock; it starts at
    its first sample, and a `tau_s` of 0 follows the raw samples."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.value = 0.0
        self._at: float | None = None

    def update(self, now: float, sample: float) -> float:
        if self._at is None or self.tau_s == 0.0:
            self.value = sample
        else:
            weight = 1.0 - math.exp(-max(now - self._at, 0.0) / self.tau_s)
            self.value += weight * (sample - self.value)
        self._at = now
        return self.value
