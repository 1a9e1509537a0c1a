"""The link's TCP proxy: every connection of every route crosses one shared `LinkShaper`.

For each accepted client the proxy connects to the route's upstream and pumps both
directions. A direction with nothing to emulate forwards each received buffer at once from a
preallocated buffer (no copy, no allocation, no queue). Otherwise each chunk is admitted to
the shaper, queued with its release time, and sent by a delivery task that sleeps until then.

Backpressure: the reader stops reading while more than `queue_bytes` of the link's wire
backlog lies ahead of its last chunk (the bottleneck buffer), while the link is down, and when
a flow holds `hold_bytes` (the in-flight bytes of a slow consumer). Bytes serialised but still
"propagating" (the one-way delay) are held without limit: they are the emulated pipe.

Sockets are driven directly with `anyio.wait_readable` / `wait_writable` and `recv_into`:
anyio's byte streams allocate a `bytes` per receive and cost about half the throughput on
this stack (docs/engineering-notes.md G3; measured 1.2 against 2.5 GB/s through one proxy).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from netem.params import LinkError, LinkParamError, LinkParams
from netem.shaper import Admission, Direction, Flow, LinkShaper, LinkStatistics

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


class ByteChannel(Protocol):
    """What the pump needs of a connection; `receive_into` returns 0 at end of stream."""

    async def receive_into(self, buffer: memoryview) -> int: ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def send_eof(self) -> None: ...


class SocketChannel:
    """A non-blocking TCP socket as a `ByteChannel`; the caller owns and closes the socket."""

    __slots__ = ("_sock",)

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    async def receive_into(self, buffer: memoryview) -> int:
        waited = False
        while True:
            try:
                received = self._sock.recv_into(buffer)
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                waited = True
                continue
            if not waited:
                # Data was ready at once: still let other tasks run and cancellation reach us.
                await anyio.lowlevel.checkpoint()
            return received

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self._sock)
                continue
            view = view[sent:]

    async def send_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)
        await anyio.lowlevel.checkpoint()


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


def _configure(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    # Clients already chose when to flush; Nagle here would only add latency.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        return family, (str(sockaddr[0]), int(sockaddr[1]))
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    return family, (host, port)


async def open_tcp(host: str, port: int) -> socket.socket:
    """Connect a non-blocking TCP socket; raises OSError naming the address on failure."""
    family, address = await _resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _configure(sock)
        code = sock.connect_ex(address)
        if code == errno.EINPROGRESS:
            await anyio.wait_writable(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, f"connect to {host}:{port}: {os.strerror(code)}")
    except BaseException:
        sock.close()
        raise
    return sock


def listen_tcp(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket (port 0 binds an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"listen on {host}:{port}: {exc.strerror}") from exc
    return sock


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
            tg.start_soon(self._serve_client, _configure(conn), route)

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
