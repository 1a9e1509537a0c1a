"""Chart series: TTFT p50/p90, throughput, egress, t, offload fraction, cache hit ratio.

Computed here, on the server, once for every browser: a page that connects mid-run gets the
history in its snapshot, a replay yields exactly the points the live run did, and the numbers
are tested in Python. The browser only draws the points.

Points are cut on *event* time (the `ts` the services stamp), not on the dashboard's clock, so
the same event stream always gives the same points whatever the delivery jitter or replay speed.
A point at time T summarises the sliding window (T - window_s, T].
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import msgspec

from services.contract.events import (
    AnyEvent,
    LinkStats,
    RequestDone,
    RoutingDecision,
    ThresholdChanged,
)
from ui.config import DashboardConfig

# Idle gaps longer than this many buckets are bridged by one jump, not a point per bucket.
MAX_GAP_POINTS = 30


class SeriesPoint(msgspec.Struct, frozen=True, tag_field="type", tag="series", kw_only=True):
    """One chart point; None where the window holds no sample (drawn as a gap)."""

    ts: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    throughput_rps: float  # requests finished per second over the window
    egress_gbps: float  # PrfaaS -> PD throughput of all links (latest fresh samples)
    bandwidth_gbps: float  # their configured rate (0 when unshaped), the egress chart's ceiling
    threshold: float | None  # t in tokens; None when the policy has no threshold
    offload: float | None  # share of the window's decisions that prefilled remotely
    cache_hit: float | None  # cached tokens / prompt tokens over the window's finished requests


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class _Done(msgspec.Struct, frozen=True):
    ts: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


class SeriesAggregator:
    """Folds events into windows and emits a `SeriesPoint` whenever event time crosses a bucket."""

    def __init__(self, config: DashboardConfig) -> None:
        self._bucket = config.bucket_s
        self._window = config.window_s
        self._prfaas = frozenset(config.prfaas_clusters)
        self._done: deque[_Done] = deque()
        self._decisions: deque[tuple[float, bool]] = deque()
        self._links: dict[str, LinkStats] = {}
        self._threshold: float | None = None
        self._first_ts: float | None = None
        self._bucket_end: float | None = None
        self.points: deque[SeriesPoint] = deque(maxlen=config.keep_points)

    def observe(self, event: AnyEvent) -> list[SeriesPoint]:
        """Records `event`; returns the points that its timestamp closed (oldest first)."""
        points = self._advance(event.ts)
        self._record(event)
        return points

    def _advance(self, ts: float) -> list[SeriesPoint]:
        if self._bucket_end is None:
            self._first_ts = ts
            self._bucket_end = (math.floor(ts / self._bucket) + 1) * self._bucket
            return []
        points: list[SeriesPoint] = []
        while ts >= self._bucket_end and len(points) < MAX_GAP_POINTS:
            points.append(self._close(self._bucket_end))
            self._bucket_end += self._bucket
        if ts >= self._bucket_end:
            self._bucket_end = (math.floor(ts / self._bucket) + 1) * self._bucket
        self.points.extend(points)
        return points

    def _record(self, event: AnyEvent) -> None:
        if isinstance(event, RequestDone) and event.ok:
            sample = _Done(event.ts, event.ttft_s, event.prompt_tokens, event.cached_tokens)
            self._done.append(sample)
        elif isinstance(event, RoutingDecision):
            self._decisions.append((event.ts, event.cluster in self._prfaas))
            self._threshold = event.threshold
        elif isinstance(event, ThresholdChanged):
            self._threshold = event.new
        elif isinstance(event, LinkStats):
            self._links[event.link] = event

    def _close(self, end: float) -> SeriesPoint:
        start = end - self._window
        while self._done and self._done[0].ts <= start:
            self._done.popleft()
        while self._decisions and self._decisions[0][0] <= start:
            self._decisions.popleft()
        done = [d for d in self._done if d.ts <= end]
        ttfts = [d.ttft_s for d in done]
        offloads = [remote for ts, remote in self._decisions if ts <= end]
        prompt = sum(d.prompt_tokens for d in done)
        fresh = [link for link in self._links.values() if link.ts > start]
        first = end if self._first_ts is None else self._first_ts
        span = max(min(self._window, end - first), self._bucket)
        return SeriesPoint(
            ts=end,
            ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
            ttft_p90_s=percentile(ttfts, 90) if ttfts else None,
            throughput_rps=len(done) / span,
            egress_gbps=sum(link.throughput_bps for link in fresh) / 1e9,
            bandwidth_gbps=sum(link.bandwidth_bps for link in fresh) / 1e9,
            threshold=self._threshold,
            offload=sum(offloads) / len(offloads) if offloads else None,
            cache_hit=sum(d.cached_tokens for d in done) / prompt if prompt else None,
        )

    def window_sizes(self) -> tuple[int, int, int]:
        """(finished requests, decisions, links) currently held; for statistics."""
        return len(self._done), len(self._decisions), len(self._links)
