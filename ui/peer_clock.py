"""How far a service's event clock is from the dashboard's, so that no timeline subtracts two
machines' clocks.

A live service stamps its events (`ts`) with its machine's CLOCK_MONOTONIC, whose origin is
that machine's boot: two machines' stamps differ by an arbitrary amount. When the dashboard
opens a service's event stream it first reads the service's clock a few times (`ClockQuery`),
each reading bracketed by its own clock, and keeps the reading with the shortest round trip,
taken as read halfway through it (NTP's estimate, off by at most half that round trip). Every
event of that stream is then moved onto the dashboard's clock by that offset. Latencies a
service reports (TTFT, TPOT, a transfer's time) are measured on that service's one clock.
"""

from __future__ import annotations

import anyio
import msgspec

from mesh.node import Node
from services.contract.messages import ClockQuery, ClockReading

# Readings per estimate: the shortest of a few round trips bounds the error well enough.
CLOCK_PROBES = 3
CLOCK_TIMEOUT_S = 5.0


class ClockSample(msgspec.Struct, frozen=True):
    """One reading of a peer's clock (`peer`), bracketed by ours (`sent`, `received`)."""

    sent: float
    peer: float
    received: float

    @property
    def round_trip(self) -> float:
        return self.received - self.sent

    @property
    def offset(self) -> float:
        """What to add to the peer's clock to read ours."""
        return (self.sent + self.received) / 2 - self.peer


def best_offset(samples: list[ClockSample]) -> float:
    """The offset of the sample with the shortest round trip."""
    if not samples:
        raise ValueError("best_offset needs at least one sample, got none")
    return min(samples, key=lambda s: s.round_trip).offset


async def peer_offset(node: Node, peer: str, probes: int = CLOCK_PROBES) -> float:
    """Reads `peer`'s event clock `probes` times; the offset onto this process's clock."""
    samples = []
    for _ in range(probes):
        sent = anyio.current_time()
        reading = await node.call(peer, ClockQuery(), ClockReading, timeout=CLOCK_TIMEOUT_S)
        samples.append(ClockSample(sent, reading.now, anyio.current_time()))
    return best_offset(samples)
