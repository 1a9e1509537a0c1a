"""The synthetic mesh's link: its parameters, the transfers on it, and what it measures.

Transfers share the link max-min fairly, so it runs at its full rate whenever one is in flight
(and it is up): its throughput over an interval is the rate times the time it was busy.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from services.contract.events import LinkStats
from ui.demo_model import UNSHAPED_BPS, Request

LOAD_SMOOTHING = 0.3  # weight of the newest sample in the smoothed utilisation


class SyntheticLinkStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset({"stalls"})

    flows: int
    throughput_bps: float
    utilisation: float
    stalls: int


class SyntheticLink:
    """Parameters in the link API's keys and units (bandwidth_bps, delay_ms, ...), as netem's."""

    def __init__(self, name: str, bandwidth_bps: float, delay_ms: float, now: float) -> None:
        self.name = name
        self.params: dict[str, Any] = {
            "bandwidth_bps": bandwidth_bps,
            "delay_ms": delay_ms,
            "jitter_ms": 0.0,
            "loss": 0.0,
            "up": True,
        }
        self.flows: list[Request] = []
        self.stalls = 0
        self.throughput_bps = 0.0
        self.utilisation = 0.0
        self.load = 0.0  # utilisation smoothed over a few samples: what the policies read
        self._busy_s = 0.0  # since the last measured sample
        self._mark = now
        self._last_sample = now

    @property
    def up(self) -> bool:
        return bool(self.params["up"])

    def rate_bps(self) -> float:
        return float(self.params["bandwidth_bps"] or 0.0) or UNSHAPED_BPS

    def share_bps(self) -> float:
        """What one transfer gets now."""
        return self.rate_bps() / max(len(self.flows), 1)

    def set(self, changes: dict[str, Any], now: float) -> None:
        self._mark_busy(now)
        self.params.update(changes)

    def add(self, request: Request, now: float) -> None:
        self._mark_busy(now)
        self.flows.append(request)

    def remove(self, request: Request, now: float) -> None:
        self._mark_busy(now)
        self.flows.remove(request)

    def _mark_busy(self, now: float) -> None:
        if self.flows and self.up:
            self._busy_s += now - self._mark
        self._mark = now

    def sample(self, now: float, measure: bool = True) -> LinkStats:
        """The link's statistics; `measure` closes an interval, else the last one repeats."""
        if measure:
            self._mark_busy(now)
            interval = now - self._last_sample
            busy = self._busy_s / interval if interval > 0 else 0.0
            self.throughput_bps = busy * self.rate_bps()
            self._busy_s, self._last_sample = 0.0, now
        self.utilisation = min(self.throughput_bps / self.rate_bps(), 1.0)
        if measure:
            self.load += LOAD_SMOOTHING * (self.utilisation - self.load)
        p = self.params
        return LinkStats(
            ts=now,
            source=self.name,
            link=self.name,
            bandwidth_bps=float(p["bandwidth_bps"] or 0.0),
            delay_s=p["delay_ms"] / 1e3,
            jitter_s=p["jitter_ms"] / 1e3,
            loss=p["loss"],
            up=p["up"],
            throughput_bps=self.throughput_bps,
            utilisation=self.utilisation,
            queued_bytes=sum(r.bytes_total - r.bytes_done for r in self.flows),
            stalls=self.stalls,
        )

    def statistics(self) -> SyntheticLinkStatistics:
        return SyntheticLinkStatistics(
            len(self.flows), self.throughput_bps, self.utilisation, self.stalls
        )
