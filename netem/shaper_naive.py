"""The link shaper's slow, obvious reference: every byte alone, in exact rational time.

Tests hold `netem.shaper.LinkShaper`'s per-chunk arithmetic equal to this model.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import NamedTuple

from netem.params import LinkParams


class ChunkEvent(NamedTuple):
    """One chunk for the reference model: wall arrival time, flow key, size in bytes."""

    arrival: float
    flow: int
    nbytes: int


class _Timeline:
    """The link clock (outages removed) and the parameters in force along it."""

    def __init__(
        self,
        params: LinkParams,
        outages: Iterable[tuple[float, float]],
        changes: Iterable[tuple[float, LinkParams]],
    ) -> None:
        self.spans = [(Fraction(a), Fraction(b)) for a, b in outages]
        # Segment k runs on the link clock from starts[k] to starts[k + 1] under settings[k].
        self.starts = [Fraction(-(10**9))]
        self.settings = [params]
        for wall, new in changes:
            self.starts.append(self.to_link(Fraction(wall)))
            self.settings.append(new)

    def to_link(self, wall: Fraction) -> Fraction:
        inside = [a for a, b in self.spans if a <= wall < b]
        if inside:
            wall = inside[0]
        return wall - sum((min(b, wall) - a for a, b in self.spans if a < wall), Fraction(0))

    def to_wall(self, link: Fraction) -> Fraction:
        wall = link
        for a, b in self.spans:
            if wall >= a:
                wall += b - a
        return wall

    def segment(self, link: Fraction) -> int:
        """The last segment starting at or before `link` (a change applies from its instant)."""
        return bisect.bisect_right(self.starts, link) - 1

    def send_byte(self, start: Fraction) -> tuple[Fraction, LinkParams]:
        """When a byte starting at `start` has left the wire, and the settings it left under.

        Its 8 bits go at each segment's rate in turn; an unshaped segment sends them at once.
        A byte that finishes exactly as a segment ends finishes in that segment.
        """
        bits, now, k = Fraction(8), start, self.segment(start)
        while True:
            rate = self.settings[k].bandwidth_bps
            if not rate:
                return now, self.settings[k]
            end = self.starts[k + 1] if k + 1 < len(self.starts) else None
            if end is None or bits <= (end - now) * Fraction(rate):
                return now + bits / Fraction(rate), self.settings[k]
            bits -= (end - now) * Fraction(rate)
            now, k = end, k + 1


def reference_release_times(
    chunks: Sequence[ChunkEvent],
    params: LinkParams,
    rng: random.Random,
    outages: Iterable[tuple[float, float]] = (),
    changes: Iterable[tuple[float, LinkParams]] = (),
) -> list[float]:
    """Slow, obvious model: every byte crosses the wire alone, in exact rational time.

    Chunks must be sorted by arrival. Byte k of the wire starts at max(its arrival, the
    previous byte's departure) on the link clock and sends its 8 bits at the rate in force
    bit by bit (a rate change mid-byte applies to the bits left). A chunk is released when
    its last byte has left, plus the delay in force at that moment, plus jitter and stall
    drawn at arrival (in the same order as `LinkShaper`, from the parameters in force at
    arrival), never before the previous chunk of its flow. Outages are (down, up) wall
    intervals, sorted and disjoint; the link clock stands still inside them. `changes` are
    (wall time, parameters) sorted by time; their `up` is ignored (outages say that).
    """
    timeline = _Timeline(params, outages, changes)
    last_byte_left = Fraction(-(10**9))
    last_release: dict[int, Fraction] = {}
    releases: list[float] = []
    for chunk in chunks:
        arrival = timeline.to_link(Fraction(chunk.arrival))
        at_arrival = timeline.settings[timeline.segment(arrival)]
        left, at_done = last_byte_left, at_arrival
        for _ in range(chunk.nbytes):
            left, at_done = timeline.send_byte(max(arrival, left))
        last_byte_left = max(arrival, left)
        jitter, stall = Fraction(0), Fraction(0)
        if at_arrival.jitter_s:
            jitter = Fraction(rng.uniform(-at_arrival.jitter_s, at_arrival.jitter_s))
        if at_arrival.loss_rate and rng.random() < at_arrival.loss_rate:
            stall = Fraction(at_arrival.rto_s)
        extra = max(Fraction(0), Fraction(at_done.delay_s) + jitter) + stall
        release = max(last_byte_left + extra, last_release.get(chunk.flow, Fraction(-(10**9))))
        last_release[chunk.flow] = release
        releases.append(float(timeline.to_wall(release)))
    return releases
