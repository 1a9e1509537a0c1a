"""The link shaper's slow, obvious reference: every byte alone, in exact rational time.

Tests hold `netem.shaper.LinkShaper`'s per-chunk arithmetic equal to this model.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import NamedTuple

from netem.shaper import LinkParams


class ChunkEvent(NamedTuple):
    """One chunk for the reference model: wall arrival time, flow key, size in bytes."""

    arrival: float
    flow: int
    nbytes: int


def reference_release_times(
    chunks: Sequence[ChunkEvent],
    params: LinkParams,
    rng: random.Random,
    outages: Iterable[tuple[float, float]] = (),
) -> list[float]:
    """Slow, obvious model: every byte crosses the wire alone, in exact rational time.

    Chunks must be sorted by arrival. Byte k of the wire leaves at max(its arrival,
    the previous byte's departure) + 8 / bandwidth, on the link clock. A chunk is released
    when its last byte has left, plus delay, jitter and stall (drawn in the same order as
    `LinkShaper`), never before the previous chunk of its flow. Outages are (down, up) wall
    intervals, sorted and disjoint; the link clock stands still inside them.
    """
    spans = [(Fraction(a), Fraction(b)) for a, b in outages]

    def to_link(wall: Fraction) -> Fraction:
        inside = [a for a, b in spans if a <= wall < b]
        if inside:
            wall = inside[0]
        return wall - sum((min(b, wall) - a for a, b in spans if a < wall), Fraction(0))

    def to_wall(link: Fraction) -> Fraction:
        wall = link
        for a, b in spans:
            if wall >= a:
                wall += b - a
        return wall

    byte_s = Fraction(8) / Fraction(params.bandwidth_bps) if params.bandwidth_bps else None
    last_byte_left = Fraction(-(10**9))
    last_release: dict[int, Fraction] = {}
    releases: list[float] = []
    for chunk in chunks:
        arrival = to_link(Fraction(chunk.arrival))
        left = max(arrival, last_byte_left)
        for _ in range(chunk.nbytes):
            left = max(arrival, left) + (byte_s or 0)
        last_byte_left = left
        extra = Fraction(params.delay_s)
        if params.jitter_s:
            draw = rng.uniform(-params.jitter_s, params.jitter_s)
            extra = max(Fraction(0), extra + Fraction(draw))
        if params.loss_rate and rng.random() < params.loss_rate:
            extra += Fraction(params.rto_s)
        release = max(left + extra, last_release.get(chunk.flow, Fraction(-(10**9))))
        last_release[chunk.flow] = release
        releases.append(float(to_wall(release)))
    return releases
