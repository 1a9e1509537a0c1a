"""The link's TCP proxy: every connection of every route crosses one shared `LinkShaper`.

For each accepted client the proxy connects to the route's upstream and pumps both
directions. A direction with nothing to emulate forwards each received buffer at once from a
preallocated buffer (no copy, no allocation, no queue). Otherwise each chunk is admitted to
the shaper, queued with its release time, and sent by a delivery task that sleeps until then.

Backpressure: the reader stops reading while more than `queue_bytes` of the link's wire
backlog lies ahead of its last chunk (the bottleneck buffer), while the link is down, and when
a flow holds `hold_bytes` (the in-flight bytes of a slow consumer). Bytes serialised but still
"propagating" (the one-way delay) are held without limit: they are the emulated pipe.

Sockets are driven directly with `anyio.wait_readable` / `wait_writable` and `recv_into`
(netem/sockets.py): anyio's byte streams allocate a `bytes` per receive and cost about half
the throughput on this stack (docs/engineering-notes.md G3 and 3d).
"""

from __future__ import annotations

import errno
import logging
import math
import socket
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from netem.params import LinkError, LinkParamError, LinkParams
from netem.shaper import Admission, Direction, Flow, LinkShaper, LinkStatistics
from netem.sockets import ByteChannel, SocketChannel, configure, listen_tcp, open_tcp

logger = logging.getLogger(__name__)


class Route(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One listen address forwarded to one upstream across the link (port 0: ephemeral)."""

    listen_port: int
    upstream_port: int
    listen_host: str = "127.0.0.1"
    upstream_host: str = "127.0.0.1"
    # The client sits on the link's far side (b -> a): its bytes cross as INGRESS
    reverse: bool = False


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`chunk_bytes` is the shaping granularity; `fast_bytes` the transparent receive size."""

    chunk_bytes: int = 64 * 1024
    fast_bytes: int = 1024 * 1024
    queue_bytes: int = 1024 * 1024
    hold_bytes: int = 64 * 1024 * 1024
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "fast_bytes", "queue_bytes", "hold_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LinkParamError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.connect_timeout_s > 0:
            raise LinkParamError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s!r}")


class ProxyStatistics(msgspec.Struct, frozen=True):
    connections_open: int
    connections_total: int
    upstream_failures: int
    connection_errors: int
    link: LinkStatistics


class _ParamSignal:
    """Wakes tasks waiting for the link to come back up (any parameter change fires it)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def event(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event

    def fire(self, _params: LinkParams) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


_Chunk = tuple[bytearray, Admission]
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _release_of(admission: Admission) -> Callable[[], float]:
    """A reader of the chunk's current release time (re-timing moves it)."""
    return lambda: admission.release


class LinkProxy:
    """Serves `routes`; all their connections share `shaper` (one link, several routes)."""

    def __init__(
        self, routes: Sequence[Route], shaper: LinkShaper, config: ProxyConfig | None = None
    ) -> None:
        if not routes:
            raise LinkParamError("routes must name at least one route, got []")
        self._routes = tuple(routes)
        self._shaper = shaper
        self._config = config or ProxyConfig()
        self._signal = _ParamSignal()
        shaper.add_listener(self._signal.fire)
        self._addresses: list[tuple[str, int]] = []
        self._open = 0
        self._total = 0
        self._upstream_failures = 0
        self._errors = 0

    @property
    def shaper(self) -> LinkShaper:
        return self._shaper

    @property
    def routes(self) -> tuple[Route, ...]:
        return self._routes

    @property
    def listen_addresses(self) -> list[tuple[str, int]]:
        """Bound (host, port) per route, in route order; empty until `run` has started."""
        return list(self._addresses)

    async def run(
        self, *, task_status: TaskStatus[list[tuple[str, int]]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on every route until cancelled; reports the bound addresses when ready."""
        listeners: list[socket.socket] = []
        try:
            for route in self._routes:
                listeners.append(listen_tcp(route.listen_host, route.listen_port))
            self._addresses = [sock.getsockname()[:2] for sock in listeners]
            async with anyio.create_task_group() as tg:
                for sock, route in zip(listeners, self._routes, strict=True):
                    tg.start_soon(self._accept_loop, sock, route, tg)
                task_status.started(self.listen_addresses)
        finally:
            for sock in listeners:
                sock.close()

    async def _accept_loop(self, listener: socket.socket, route: Route, tg: TaskGroup) -> None:
        while True:
            await anyio.wait_readable(listener)
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno not in _ACCEPT_RESOURCE_ERRORS:
                    raise
                # Out of descriptors or memory: wait for some to free rather than spin.
                logger.error(
                    "accept on %s:%d failed: %s", route.listen_host, route.listen_port, exc
                )
                await anyio.sleep(0.1)
                continue
            tg.start_soon(self._serve_client, configure(conn), route)

    async def _serve_client(self, conn: socket.socket, route: Route) -> None:
        with conn:
            try:
                with anyio.fail_after(self._config.connect_timeout_s):
                    upstream = await open_tcp(route.upstream_host, route.upstream_port)
            except OSError as exc:
                self._upstream_failures += 1
                logger.warning("upstream unreachable, closing client: %s", exc)
                return
            # Several connections share a route (KV lanes): the client's port tells them apart.
            name = f"{_port_of(conn)} -> {route.upstream_host}:{route.upstream_port}"
            with upstream:
                await self._serve_pair(SocketChannel(conn), SocketChannel(upstream),
                                       route.reverse, name)

    async def _serve_pair(self, client: SocketChannel, upstream: SocketChannel,
                          reverse: bool, name: str = "") -> None:
        self._open += 1
        self._total += 1
        try:
            await self.pump_connection(client, upstream, reverse=reverse)
        except* OSError as group:
            # A reset or broken pipe ends this connection only, never the proxy.
            self._errors += 1
            first = _first_leaf(group)
            logger.info("connection %s closed on error: %s: %s", name, type(first).__name__,
                        first)
        finally:
            self._open -= 1

    async def pump_connection(self, client: ByteChannel, upstream: ByteChannel, *,
                              reverse: bool = False) -> None:
        """Pump both directions until both reach end of stream (half-close is forwarded).
        The client's bytes are EGRESS (a -> b), or INGRESS on a `reverse` route."""
        out, back = ((Direction.INGRESS, Direction.EGRESS) if reverse
                     else (Direction.EGRESS, Direction.INGRESS))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, client, upstream, out)
            tg.start_soon(self._pump, upstream, client, back)

    async def _pump(self, src: ByteChannel, dst: ByteChannel, direction: Direction) -> None:
        flow = self._shaper.open_flow(direction)
        max_chunks = max(1, self._config.hold_bytes // self._config.chunk_bytes)
        send, receive = anyio.create_memory_object_stream[_Chunk](max_chunks)
        try:
            async with send, receive, anyio.create_task_group() as tg:
                tg.start_soon(self._deliver, receive, dst, flow)
                await self._read(src, dst, send, flow)
                send.close()
            await dst.send_eof()
        finally:
            self._shaper.close_flow(flow)

    async def _read(
        self, src: ByteChannel, dst: ByteChannel, queue: MemoryObjectSendStream[_Chunk], flow: Flow
    ) -> None:
        """Reader: forward on the fast path when nothing is queued, else admit and queue."""
        fast = memoryview(bytearray(self._config.fast_bytes))
        shaper = self._shaper
        while True:
            if shaper.transparent(flow.direction) and not flow.queued_bytes:
                received = await src.receive_into(fast)
                if not received:
                    return
                # Parameters may have changed while we waited for data.
                if shaper.transparent(flow.direction):
                    shaper.passthrough(flow, received)
                    await dst.send_all(fast[:received])
                else:
                    await self._enqueue(queue, flow, bytearray(fast[:received]))
                continue
            chunk = bytearray(self._config.chunk_bytes)
            received = await src.receive_into(memoryview(chunk))
            if not received:
                return
            del chunk[received:]
            await self._enqueue(queue, flow, chunk)

    async def _enqueue(
        self, queue: MemoryObjectSendStream[_Chunk], flow: Flow, chunk: bytearray
    ) -> None:
        admission = self._shaper.admit(flow, len(chunk))
        await queue.send((chunk, admission))
        await self._wait_link(lambda: admission.wire_done - self._queue_s())

    def _queue_s(self) -> float:
        """The bottleneck buffer in seconds of wire time at the current rate."""
        bandwidth = self._shaper.params.bandwidth_bps
        return self._config.queue_bytes * 8.0 / bandwidth if bandwidth else math.inf

    async def _deliver(
        self, queue: MemoryObjectReceiveStream[_Chunk], dst: ByteChannel, flow: Flow
    ) -> None:
        async for chunk, admission in queue:
            await self._wait_link(_release_of(admission))
            await dst.send_all(chunk)
            self._shaper.released(flow, len(chunk))

    async def _wait_link(self, link_time: Callable[[], float]) -> None:
        """Sleep until the link clock reaches `link_time()`, across outages and changes.

        `link_time` is read again after every parameter change: a new rate re-times queued
        chunks (earlier or later), so a sleeper must not keep a stale deadline.
        """
        while True:
            changed = self._signal.event()
            wall = self._shaper.wall_time(link_time())
            if wall <= self._shaper.now():
                return
            with anyio.CancelScope(deadline=wall):
                await changed.wait()

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(
            connections_open=self._open,
            connections_total=self._total,
            upstream_failures=self._upstream_failures,
            connection_errors=self._errors,
            link=self._shaper.statistics(),
        )

    def check_integrity(self) -> None:
        self._shaper.check_integrity()
        if not 0 <= self._open <= self._total:
            raise LinkError(f"connections_open={self._open} outside [0, {self._total}]")


def _first_leaf(group: BaseExceptionGroup[OSError]) -> BaseException:
    """The first exception of a (nested) group: what actually ended the connection."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _port_of(conn: socket.socket) -> str:
    """The client's port ("?" once it is gone)."""
    try:
        return str(conn.getpeername()[1])
    except OSError:
        return "?"
