"""Pure, clock-driven link shaping: when may a chunk that entered the link leave it.

The link is one FIFO "wire" per direction, shared by every connection crossing it. A chunk of
n bytes entering at time t starts serialising when the wire is free, occupies it for
8n / bandwidth seconds, then travels for the one-way delay plus a seeded jitter draw. With
probability `loss_rate` the chunk also suffers a retransmission stall of `rto_s` (a lost
segment that TCP resends after its timeout). A connection's chunks never overtake each
other: jitter delays a chunk, it never reorders a stream.

An outage pauses the link: while it is down, no time passes on the link and nothing is
released; everything scheduled shifts later by the outage's length. The shaper keeps two
clocks for this: the injected wall clock, and the link clock (wall time minus time spent
down). Release times are computed on the link clock and converted back with `wall_time`.

A live change of rate or delay re-times the backlog, as a real bottleneck queue drains: bytes
still waiting for (or on) the wire at the change leave from now at the new rate and take the
new delay; chunks already fully serialised keep their release time. Release times therefore
live in `Admission` objects that the shaper updates in place, and the proxy re-reads them
after every parameter change.

No I/O happens here; the proxy (netem/proxy.py) sleeps until the times this module computes.
`netem.shaper_naive.reference_release_times` is the slow, obvious per-byte model the fast
arithmetic is tested against.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from collections.abc import Callable

import msgspec

from netem.params import LinkError, LinkParamError, LinkParams
from netem.rate import RateWindow


class Direction(enum.Enum):
    """EGRESS is client -> upstream (PrfaaS egress); INGRESS is the reverse."""

    EGRESS = "egress"
    INGRESS = "ingress"


class Admission:
    """One admitted chunk: its link-clock serialisation end and release, kept current.

    The shaper moves both when a rate or delay change re-times the backlog, so holders must
    read them again after a change rather than keep copies. `jitter` and `stall` are the
    random draws made at admission; the delay itself is taken when the chunk's last byte
    leaves the wire.
    """

    __slots__ = ("flow", "jitter", "nbytes", "release", "stall", "wire_done")

    def __init__(
        self, flow: Flow, nbytes: int, wire_done: float, jitter: float, stall: float
    ) -> None:
        self.flow = flow
        self.nbytes = nbytes
        self.wire_done = wire_done
        self.jitter = jitter
        self.stall = stall
        self.release = wire_done

    def __repr__(self) -> str:
        return f"Admission(wire_done={self.wire_done!r}, release={self.release!r})"


class DirectionStatistics(msgspec.Struct, frozen=True):
    bytes_in: int
    bytes_out: int
    bytes_dropped: int
    chunks_in: int
    queued_bytes: int
    wire_backlog_s: float
    throughput_bps: float
    utilisation: float
    stalls: int
    stall_s: float
    flows: int


class LinkStatistics(msgspec.Struct, frozen=True):
    time: float
    params: LinkParams
    outages: int
    down_s: float
    egress: DirectionStatistics
    ingress: DirectionStatistics


class Flow:
    """One connection's direction across the link: its FIFO order and its queued bytes.

    `last_release` is the release of its newest chunk; `settled_release` that of its newest
    chunk already off the wire (a re-timing restarts the flow's order from there).
    """

    __slots__ = ("direction", "last_release", "queued_bytes", "settled_release")

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.last_release = -math.inf
        self.settled_release = -math.inf
        self.queued_bytes = 0


class _DirectionState:
    def __init__(self, window_s: float) -> None:
        self.wire_free = -math.inf
        # Shaped chunks whose last byte has not left the wire yet, in wire (FIFO) order.
        self.on_wire: deque[Admission] = deque()
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_dropped = 0
        self.chunks_in = 0
        self.stalls = 0
        self.stall_s = 0.0
        self.flows: set[Flow] = set()
        self.out_rate = RateWindow(window_s)


def _drain_changed(old: LinkParams, new: LinkParams) -> bool:
    """Whether the backlog drains differently: a new rate or a new delay."""
    return (old.bandwidth_bps or None, old.delay_s) != (new.bandwidth_bps or None, new.delay_s)


def _remaining_s(left_s: float, old_bandwidth: float | None, rate: float) -> float:
    """Serialisation time left at `rate` for what would have taken `left_s` at the old rate."""
    if not old_bandwidth or rate == math.inf:
        return 0.0
    return left_s * old_bandwidth / rate


class LinkShaper:
    """The link's shaping state, shared by every connection of every route across it."""

    def __init__(
        self,
        params: LinkParams,
        clock: Callable[[], float],
        rng: random.Random,
        *,
        shape_ingress: bool = True,
        window_s: float = 1.0,
    ) -> None:
        if not window_s > 0:
            raise LinkParamError(f"window_s must be > 0, got {window_s!r}")
        self._params = params
        self._clock = clock
        self._rng = rng
        self._shape_ingress = shape_ingress
        self._states = {d: _DirectionState(window_s) for d in Direction}
        self._listeners: list[Callable[[LinkParams], None]] = []
        self._paused_s = 0.0
        # A link created down is in an outage from now on (the clock must be usable here).
        self._down_since: float | None = None if params.up else clock()
        self._outages = 0 if params.up else 1
        self._transparent = self._compute_transparent()

    @property
    def params(self) -> LinkParams:
        return self._params

    def now(self) -> float:
        """The injected wall clock (the proxy sleeps on the same one)."""
        return self._clock()

    def set_params(self, params: LinkParams) -> None:
        """Apply new parameters live; a new rate or delay re-times the backlog from now."""
        now = self._clock()
        if self._params.up and not params.up:
            self._down_since = now
            self._outages += 1
        elif not self._params.up and params.up and self._down_since is not None:
            self._paused_s += now - self._down_since
            self._down_since = None
        old = self._params
        self._params = params
        if _drain_changed(old, params):
            for direction in self._shaped_directions():
                self._retime(self._states[direction], old.bandwidth_bps)
        self._transparent = self._compute_transparent()
        for listener in list(self._listeners):
            listener(params)

    def _shaped_directions(self) -> tuple[Direction, ...]:
        if self._shape_ingress:
            return (Direction.EGRESS, Direction.INGRESS)
        return (Direction.EGRESS,)

    def _settle(self, state: _DirectionState, link_time: float) -> None:
        """Forget chunks fully serialised before `link_time`: their release is final.

        Strictly before: a chunk whose last bit leaves at `link_time` itself takes the delay
        set at that instant, as in the per-byte reference. This matters in an outage, whose
        link clock stands still: a chunk that would be done at the frozen time waits with
        the rest for the link to come back, and a delay set meanwhile applies to it."""
        on_wire = state.on_wire
        while on_wire and on_wire[0].wire_done < link_time:
            done = on_wire.popleft()
            done.flow.settled_release = done.release

    def _retime(self, state: _DirectionState, old_bandwidth: float | None) -> None:
        """Drain what is still on the wire from now at the current rate and delay.

        The wire is busy without a gap from now until the last waiting byte (every chunk on
        it arrived before now), so its remaining bits are (wire_free - now) * old rate.
        """
        now = self.link_now()
        self._settle(state, now)
        if not state.on_wire:
            return
        rate = self._params.bandwidth_bps or math.inf
        # The chunk in progress keeps the bits it has sent; its remaining bits go at the new
        # rate, then every later chunk whole. While the link is down a chunk done at the
        # frozen link time came during the outage on an unshaped link: it has sent nothing.
        first = state.on_wire[0]
        if self._down_since is not None and first.wire_done == now:
            wire = now + first.nbytes * 8.0 / rate
        else:
            wire = now + _remaining_s(first.wire_done - now, old_bandwidth, rate)
        last_release: dict[Flow, float] = {}
        for index, chunk in enumerate(state.on_wire):
            if index:
                wire += chunk.nbytes * 8.0 / rate
            chunk.wire_done = wire
            floor = last_release.get(chunk.flow, chunk.flow.settled_release)
            chunk.release = max(wire + self._extra(chunk), floor)
            last_release[chunk.flow] = chunk.release
        state.wire_free = wire
        for flow, release in last_release.items():
            flow.last_release = release

    def _extra(self, chunk: Admission) -> float:
        """Time from a chunk's last byte leaving the wire to its release (current delay)."""
        return max(0.0, self._params.delay_s + chunk.jitter) + chunk.stall

    def add_listener(self, listener: Callable[[LinkParams], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[LinkParams], None]) -> None:
        self._listeners.remove(listener)

    def transparent(self, direction: Direction) -> bool:
        """True when chunks of this direction may skip the queue (nothing to emulate)."""
        return self._transparent[direction]

    def _compute_transparent(self) -> dict[Direction, bool]:
        unshaped_ingress = self._params.up and not self._shape_ingress
        return {
            Direction.EGRESS: self._params.transparent,
            Direction.INGRESS: self._params.transparent or unshaped_ingress,
        }

    def link_now(self) -> float:
        """The link clock: wall time minus time spent down (frozen while down)."""
        if self._down_since is not None:
            return self._down_since - self._paused_s
        return self._clock() - self._paused_s

    def wall_time(self, link_time: float) -> float:
        """Wall time at which the link clock reaches `link_time`; inf while down."""
        if self._down_since is not None:
            return math.inf
        return link_time + self._paused_s

    def open_flow(self, direction: Direction) -> Flow:
        flow = Flow(direction)
        self._states[direction].flows.add(flow)
        return flow

    def close_flow(self, flow: Flow) -> None:
        """Forget a flow; bytes it still had queued count as dropped."""
        state = self._states[flow.direction]
        state.flows.discard(flow)
        state.bytes_dropped += flow.queued_bytes
        flow.queued_bytes = 0

    def admit(self, flow: Flow, nbytes: int) -> Admission:
        """Schedule a chunk entering now; its times stay current until it leaves the wire."""
        params = self._params
        state = self._states[flow.direction]
        now = self.link_now()
        start = max(now, state.wire_free)
        shaped = flow.direction is Direction.EGRESS or self._shape_ingress
        bandwidth = params.bandwidth_bps if shaped else None
        wire_done = start + nbytes * 8.0 / bandwidth if bandwidth else start
        state.wire_free = wire_done
        if shaped:
            jitter, stall = self._draw(params, state)
            admission = Admission(flow, nbytes, wire_done, jitter, stall)
            admission.release = max(wire_done + self._extra(admission), flow.last_release)
            self._settle(state, now)
            state.on_wire.append(admission)
        else:
            admission = Admission(flow, nbytes, wire_done, 0.0, 0.0)
            admission.release = max(wire_done, flow.last_release)
        flow.last_release = admission.release
        flow.queued_bytes += nbytes
        state.bytes_in += nbytes
        state.chunks_in += 1
        return admission

    def _draw(self, params: LinkParams, state: _DirectionState) -> tuple[float, float]:
        """The chunk's jitter offset and loss stall, drawn once at admission."""
        # Draw order (jitter, then loss) is part of the contract with the reference model.
        jitter = self._rng.uniform(-params.jitter_s, params.jitter_s) if params.jitter_s else 0.0
        if params.loss_rate and self._rng.random() < params.loss_rate:
            state.stalls += 1
            state.stall_s += params.rto_s
            return jitter, params.rto_s
        return jitter, 0.0

    def released(self, flow: Flow, nbytes: int) -> None:
        """Account a queued chunk as delivered to the far side."""
        if nbytes > flow.queued_bytes:
            raise LinkError(f"released {nbytes} bytes but the flow queued {flow.queued_bytes}")
        flow.queued_bytes -= nbytes
        state = self._states[flow.direction]
        state.bytes_out += nbytes
        state.out_rate.add(self._clock(), nbytes)

    def passthrough(self, flow: Flow, nbytes: int) -> None:
        """Account a chunk forwarded on the transparent fast path (never queued)."""
        state = self._states[flow.direction]
        state.bytes_in += nbytes
        state.bytes_out += nbytes
        state.chunks_in += 1
        state.out_rate.add(self._clock(), nbytes)

    def statistics(self) -> LinkStatistics:
        now = self._clock()
        down_s = self._paused_s + (now - self._down_since if self._down_since is not None else 0)
        return LinkStatistics(
            time=now,
            params=self._params,
            outages=self._outages,
            down_s=down_s,
            egress=self._direction_statistics(Direction.EGRESS, now),
            ingress=self._direction_statistics(Direction.INGRESS, now),
        )

    def _direction_statistics(self, direction: Direction, now: float) -> DirectionStatistics:
        state = self._states[direction]
        throughput = state.out_rate.rate(now) * 8.0
        bandwidth = self._params.bandwidth_bps
        shaped = direction is Direction.EGRESS or self._shape_ingress
        utilisation = throughput / bandwidth if bandwidth and shaped else 0.0
        return DirectionStatistics(
            bytes_in=state.bytes_in,
            bytes_out=state.bytes_out,
            bytes_dropped=state.bytes_dropped,
            chunks_in=state.chunks_in,
            queued_bytes=state.bytes_in - state.bytes_out - state.bytes_dropped,
            wire_backlog_s=max(0.0, state.wire_free - self.link_now()),
            throughput_bps=throughput,
            utilisation=utilisation,
            stalls=state.stalls,
            stall_s=state.stall_s,
            flows=len(state.flows),
        )

    def check_integrity(self) -> None:
        """Byte conservation per direction: in = out + dropped + queued in open flows."""
        for direction, state in self._states.items():
            queued = sum(flow.queued_bytes for flow in state.flows)
            if state.bytes_in != state.bytes_out + state.bytes_dropped + queued:
                raise LinkError(
                    f"{direction.value}: bytes_in={state.bytes_in} != bytes_out="
                    f"{state.bytes_out} + dropped={state.bytes_dropped} + queued={queued}"
                )
            if any(flow.direction is not direction for flow in state.flows):
                raise LinkError(f"{direction.value}: a flow of another direction is registered")
            times = [chunk.wire_done for chunk in state.on_wire]
            if times != sorted(times) or any(t > state.wire_free for t in times):
                raise LinkError(f"{direction.value}: the wire is out of order: {times[:8]}")
        if (self._down_since is None) != self._params.up:
            raise LinkError(f"up={self._params.up} but down_since={self._down_since}")
