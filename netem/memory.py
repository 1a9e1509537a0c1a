"""The link on an in-memory network: the same `LinkShaper` between two in-process clusters.

The simulation (and tests) run every service in one event loop over a `mesh.transport.MemoryHub`.
`MemoryLink` listens there on each route's address and forwards to its upstream, frame by
frame, each frame held until the shaper releases it, exactly as the TCP proxy holds chunks
(netem/proxy.py). A frame's size on the wire is what `weight(frame)` says: its length, or
for a frame that stands for a larger payload (a simulated KV piece carries its size, not its
bytes) that size, so the link is as busy as the real one would be without the bytes existing.

Backpressure as the proxy's: a reader stops reading while more than `queue_bytes` of the
link's wire backlog lies ahead of the end of its last frame (ProxyConfig.queue_bytes, the
bottleneck buffer), so a congested link holds its senders, not an unbounded queue. The
in-memory pipe in front of it holds a few more frames, as a socket's buffers do.

Each direction of a connection has a reader, which admits frames to the shaper, and a
deliverer, which sends each frame on at its release. They share a plain queue and sleep on
`mesh.native.Alarm`s: a deliverer with nothing held parks until the reader moves its alarm to
the next frame's release, so a frame costs it one wake-up, at that release (a queue to
wake it, then a timed sleep, took three scheduler passes a frame and a third of the link's
cost in the simulation). A change of the link's parameters wakes every sleeper to re-read
its times. While a reader waits for a chunk, a sender's chunk that is one whole frame is
admitted in the sending task as the pipe hands it over, when the link has room (the
in-memory form of a proxy reading in its socket callback): the reader is not woken for it.
A chunk that finds no room stays in the pipe until there is, exactly as it would for the
reader; `senders_admit=False` turns this off, and the tests hold both to the same times.

Frames are the mesh's: a 4-byte big-endian length, then the body (mesh/wire.py).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

import anyio
import anyio.abc
import msgspec

from mesh.native import Alarm
from mesh.transport import Address, Chunk, MemoryByteStream, MemoryHub
from mesh.wire import HEADER_SIZE
from netem.proxy import ProxyConfig
from netem.shaper import Admission, Direction, Flow, LinkShaper, LinkStatistics

log = logging.getLogger(__name__)

Weight = Callable[[memoryview], int]
_Held = tuple[Chunk, Admission, int]


def _release_of(admission: Admission) -> float:
    return admission.release  # read again after a change: a new rate re-times the backlog


class MemoryRoute(msgspec.Struct, frozen=True):
    """Connections to `listen` are forwarded to `upstream` through the link; a `reverse`
    route's senders are on the link's far side (their bytes count as ingress)."""

    listen: Address
    upstream: Address
    reverse: bool = False


class MemoryLinkStatistics(msgspec.Struct, frozen=True):
    connections_open: int
    connections_total: int
    frames: int
    link: LinkStatistics


def frames(buffer: bytearray) -> list[bytes]:
    """Whole frames cut from the front of `buffer` (header included); the rest stays."""
    out: list[bytes] = []
    offset = 0
    while len(buffer) - offset >= HEADER_SIZE:
        size = int.from_bytes(buffer[offset:offset + HEADER_SIZE], "big")
        end = offset + HEADER_SIZE + size
        if end > len(buffer):
            break
        out.append(bytes(buffer[offset:end]))
        offset = end
    del buffer[:offset]
    return out


def _whole_frame(chunk: Chunk) -> bool:
    return len(chunk) >= HEADER_SIZE and (
        int.from_bytes(chunk[:HEADER_SIZE], "big") == len(chunk) - HEADER_SIZE)


def frames_of(buffer: bytearray, chunk: Chunk) -> list[Chunk]:
    """`frames(buffer + chunk)`, without a copy when nothing is buffered and `chunk` is one
    whole frame: what the mesh writes into an in-memory pipe, one frame per chunk."""
    if not buffer and _whole_frame(chunk):
        return [chunk]
    buffer += chunk
    return list(frames(buffer))


class _Pipe:
    """One direction of one connection across the link: its flow, the frames admitted and
    not yet delivered (in order), and the alarms its reader and deliverer sleep on."""

    __slots__ = ("blocked", "delivering", "ended", "flow", "held", "parked", "reading")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.held: deque[_Held] = deque()
        self.ended = False
        self.reading = Alarm()
        self.delivering = Alarm()
        # The reader waits for a chunk with nothing buffered: a sender's chunk may be
        # admitted in the sending task (`MemoryLink._take`).
        self.parked = False
        # A frame so admitted left less room than the reader needs to read on: the next
        # chunk waits in the pipe until there is room after this admission.
        self.blocked: Admission | None = None

    @property
    def needs_room(self) -> bool:
        """A frame admitted in a sender's task left the reader without room (`blocked`)."""
        return self.blocked is not None


class MemoryLink:
    """Serves `routes` on `hub`; every connection shares `shaper` (one link)."""

    def __init__(self, hub: MemoryHub, routes: Sequence[MemoryRoute], shaper: LinkShaper,
                 weight: Weight = len, queue_bytes: int = ProxyConfig().queue_bytes, *,
                 senders_admit: bool = True) -> None:
        """`senders_admit=False` leaves every frame to the readers: the plain form that the
        admission in senders' tasks (`_take`) is tested equal to."""
        self._hub = hub
        self._senders_admit = senders_admit
        self._queue_bytes = queue_bytes
        self._routes = tuple(routes)
        self._shaper = shaper
        self._weight = weight
        self._pipes: set[_Pipe] = set()
        shaper.add_listener(self._on_change)
        self._open = self._total = self._frames = 0

    @property
    def shaper(self) -> LinkShaper:
        return self._shaper

    def _on_change(self, _params: object) -> None:
        for pipe in self._pipes:
            pipe.reading.wake()
            pipe.delivering.wake()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
                  ) -> None:
        """Listen on every route until cancelled."""
        async with anyio.create_task_group() as tg:
            for route in self._routes:
                listener = await self._listen(route)
                tg.start_soon(self._accept, listener, route, tg)
            task_status.started(None)

    async def _listen(self, route: MemoryRoute) -> anyio.abc.Listener[anyio.abc.ByteStream]:
        await anyio.lowlevel.checkpoint()
        return self._hub.register(route.listen)

    async def _accept(self, listener: anyio.abc.Listener[anyio.abc.ByteStream],
                      route: MemoryRoute, tg: anyio.abc.TaskGroup) -> None:
        async with listener:
            await listener.serve(lambda client: self._serve(client, route), tg)

    async def _serve(self, client: anyio.abc.ByteStream, route: MemoryRoute) -> None:
        self._open += 1
        self._total += 1
        try:
            async with client, await self._hub.connect(route.upstream) as upstream, \
                    anyio.create_task_group() as tg:
                out, back = (Direction.INGRESS, Direction.EGRESS) if route.reverse else (
                    Direction.EGRESS, Direction.INGRESS)
                tg.start_soon(self._pump, client, upstream, out)
                tg.start_soon(self._pump, upstream, client, back)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError) as exc:
            # One side went away: this connection ends, the link goes on.
            log.debug("link connection to %s ended: %r", route.upstream, exc)
        finally:
            self._open -= 1

    async def _pump(self, src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream,
                    direction: Direction) -> None:
        """Reader admits each whole frame as it arrives; the deliverer sends it on release."""
        pipe = _Pipe(self._shaper.open_flow(direction))
        self._pipes.add(pipe)
        pushed = src if self._senders_admit and isinstance(src, MemoryByteStream) else None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._deliver, pipe, dst)
                try:
                    if pushed is not None:
                        pushed.deliver_to(partial(self._take, pipe))
                    await self._read(src, pipe, pushed)
                finally:
                    if pushed is not None:
                        pushed.deliver_to(None)
                    pipe.ended = True
                    pipe.delivering.wake()
        finally:
            self._pipes.discard(pipe)
            self._shaper.close_flow(pipe.flow)

    async def _read(self, src: anyio.abc.ByteStream, pipe: _Pipe,
                    pushed: MemoryByteStream | None) -> None:
        """Admits the frames of each chunk read, waiting for room after each; while it waits
        for a chunk with room, senders' whole frames are admitted in their own tasks
        (`_take`), and a chunk that finds the link without room stays in the pipe until
        there is room, as it would for this reader."""
        buffer = bytearray()
        while True:
            try:
                if pipe.blocked is not None:
                    await self._wait_link(pipe.reading, partial(self._room_at, pipe.blocked))
                    pipe.blocked = None
                if pushed is not None and not buffer:
                    pipe.parked = True
                    try:
                        await pushed.wait_readable()
                    finally:
                        pipe.parked = False
                    if pipe.needs_room:
                        continue
                chunk = await src.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return
            for frame in frames_of(buffer, chunk):
                admission = self._admit(pipe, frame)
                await self._wait_link(pipe.reading, partial(self._room_at, admission))

    def _take(self, pipe: _Pipe, chunk: Chunk) -> bool:
        """A sender's chunk, offered by the pipe while nothing is queued in it: admitted now
        (True) if the reader waits for a chunk, there is room, and it is one whole frame;
        else left to the reader (False). The reader's wake-up for it is saved."""
        if not pipe.parked or not _whole_frame(chunk):
            return False
        if pipe.blocked is not None:
            if not self._reached(self._room_at(pipe.blocked)):
                return False
            pipe.blocked = None
        admission = self._admit(pipe, chunk)
        if not self._reached(self._room_at(admission)):
            pipe.blocked = admission
        return True

    def _reached(self, link_time: float) -> bool:
        return self._shaper.wall_time(link_time) <= self._shaper.now()

    def _admit(self, pipe: _Pipe, frame: Chunk) -> Admission:
        size = self._weight(memoryview(frame)[HEADER_SIZE:]) + HEADER_SIZE
        admission = self._shaper.admit(pipe.flow, size)
        pipe.held.append((frame, admission, size))
        if len(pipe.held) == 1:
            # The deliverer parks with nothing due: due now, at this frame's release.
            pipe.delivering.move(self._shaper.wall_time(admission.release))
        return admission

    def _room_at(self, admission: Admission) -> float:
        """Link time from which at most `queue_bytes` of the backlog lie ahead of the end of
        `admission` (at the current rate, as the proxy reckons it)."""
        bandwidth = self._shaper.params.bandwidth_bps
        queue_s = self._queue_bytes * 8.0 / bandwidth if bandwidth else math.inf
        return admission.wire_done - queue_s

    async def _deliver(self, pipe: _Pipe, dst: anyio.abc.ByteStream) -> None:
        held = pipe.held
        while held or not pipe.ended:
            if not held:
                await pipe.delivering.sleep_until(math.inf)
                continue
            frame, admission, size = held[0]
            await self._wait_link(pipe.delivering, partial(_release_of, admission))
            held.popleft()
            # Streams take any buffer (typed bytes); the sender never reuses a frame (G8).
            await dst.send(frame)  # type: ignore[arg-type]
            self._shaper.released(pipe.flow, size)
            self._frames += 1
        await dst.send_eof()

    async def _wait_link(self, alarm: Alarm, link_time: Callable[[], float]) -> None:
        """Sleep until the link clock reaches `link_time()`, read again after every change
        (a new rate re-times the backlog: `_on_change` wakes every sleeper)."""
        while True:
            wall = self._shaper.wall_time(link_time())
            if wall <= self._shaper.now():
                return
            await alarm.sleep_until(wall)

    def statistics(self) -> MemoryLinkStatistics:
        return MemoryLinkStatistics(self._open, self._total, self._frames,
                                    self._shaper.statistics())
