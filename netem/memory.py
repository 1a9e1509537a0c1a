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

Frames are the mesh's: a 4-byte big-endian length, then the body (mesh/wire.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from functools import partial

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from mesh.transport import Address, MemoryHub
from mesh.wire import HEADER_SIZE
from netem.proxy import ProxyConfig
from netem.shaper import Admission, Direction, Flow, LinkShaper, LinkStatistics

log = logging.getLogger(__name__)

Weight = Callable[[memoryview], int]
_Held = tuple[bytes, Admission, int]


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


class MemoryLink:
    """Serves `routes` on `hub`; every connection shares `shaper` (one link)."""

    def __init__(self, hub: MemoryHub, routes: Sequence[MemoryRoute], shaper: LinkShaper,
                 weight: Weight = len, queue_bytes: int = ProxyConfig().queue_bytes) -> None:
        self._hub = hub
        self._queue_bytes = queue_bytes
        self._routes = tuple(routes)
        self._shaper = shaper
        self._weight = weight
        self._changed = anyio.Event()
        shaper.add_listener(self._on_change)
        self._open = self._total = self._frames = 0

    @property
    def shaper(self) -> LinkShaper:
        return self._shaper

    def _on_change(self, _params: object) -> None:
        self._changed.set()
        self._changed = anyio.Event()

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
        flow = self._shaper.open_flow(direction)
        send, receive = anyio.create_memory_object_stream[_Held](math.inf)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._deliver, receive, dst, flow)
                await self._read(src, send, flow)
        finally:
            self._shaper.close_flow(flow)

    async def _read(self, src: anyio.abc.ByteStream, queue: MemoryObjectSendStream[_Held],
                    flow: Flow) -> None:
        buffer = bytearray()
        async with queue:
            while True:
                try:
                    chunk = await src.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    return
                buffer += chunk
                for frame in frames(buffer):
                    size = self._weight(memoryview(frame)[HEADER_SIZE:]) + HEADER_SIZE
                    admission = self._shaper.admit(flow, size)
                    queue.send_nowait((frame, admission, size))
                    await self._wait_link(partial(self._room_at, admission))

    def _room_at(self, admission: Admission) -> float:
        """Link time from which at most `queue_bytes` of the backlog lie ahead of the end of
        `admission` (at the current rate, as the proxy reckons it)."""
        bandwidth = self._shaper.params.bandwidth_bps
        queue_s = self._queue_bytes * 8.0 / bandwidth if bandwidth else math.inf
        return admission.wire_done - queue_s

    async def _deliver(self, queue: MemoryObjectReceiveStream[_Held],
                       dst: anyio.abc.ByteStream, flow: Flow) -> None:
        async with queue:
            async for frame, admission, size in queue:
                await self._wait_link(partial(_release_of, admission))
                await dst.send(frame)
                self._shaper.released(flow, size)
                self._frames += 1
        await dst.send_eof()

    async def _wait_link(self, link_time: Callable[[], float]) -> None:
        """Sleep until the link clock reaches `link_time()`, read again after every change
        (a new rate re-times the backlog)."""
        while True:
            changed = self._changed
            wall = self._shaper.wall_time(link_time())
            if wall <= self._shaper.now():
                return
            with anyio.CancelScope(deadline=wall):
                await changed.wait()

    def statistics(self) -> MemoryLinkStatistics:
        return MemoryLinkStatistics(self._open, self._total, self._frames,
                                    self._shaper.statistics())
