"""A node: one named actor with typed handlers, a bounded mailbox, and links to its peers.

Register handlers by message type, enter the node (it runs its workers, listeners and
connection readers in one task group it owns), listen, and talk to peers by name:

    node = Node("b", codec, TcpTransport(), topology.address)

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n)

    async with node:
        await node.listen()
        pong = await node.call("a", Ping(1), Pong, timeout=2.0)

Three handler kinds: `handles` (request/reply with `call`, or one-way with `cast`),
`serves_stream` (an async generator; the caller reads it with `open_stream`) and
`accepts_stream` (reads the caller's items; the caller writes them with `stream_to`). Each
takes `slots=N` to run that message type's requests in a pool of their own (mesh.pools),
beside the node's shared `max_concurrency` slots. Outgoing connections are dialled on first
use, cached per peer, and redialled after a loss (mesh.peers); incoming ones are admitted up
to `max_connections` and must finish their handshake in time (mesh.incoming).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, ClassVar, TypeVar, overload

import anyio
import anyio.abc
import msgspec

from mesh import native
from mesh.client import ClientSession, StreamReader, StreamSink, unwrap
from mesh.config import NodeConfig
from mesh.connection import Connection, ConnectionStatistics
from mesh.errors import ConfigError, MeshError, UnexpectedReply
from mesh.handlers import (
    Handlers,
    Request,
    StreamHandler,
    UnaryHandler,
    UploadHandler,
)
from mesh.incoming import Incoming
from mesh.mailbox import Mailbox, MailboxStatistics
from mesh.membership import check_secret, require_secret_beyond_loopback
from mesh.peers import Peers
from mesh.pools import Pool, Pools, PoolStatistics, check_slots
from mesh.server import ServerSession
from mesh.slots import Slots, SlotStatistics
from mesh.transport import Address, Transport
from mesh.wire import Codec, wire_timeout

__all__ = ["Node", "NodeConfig", "NodeStatistics"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)
# A handler of any of the three kinds (mesh.handlers).
H = TypeVar("H")


class NodeStatistics(msgspec.Struct, frozen=True):
    """A node's traffic, work and queue depths; counters only grow."""

    counters: ClassVar[frozenset[str]] = frozenset(
        {"requests_in", "handler_errors", "deadlines_in", "calls_out", "casts_out",
         "streams_out", "deadlines_out", "stray_frames", "connection_errors",
         "frames_in", "frames_out", "bytes_in", "bytes_out", "requests_eager",
         "requests_handed_off", "connections_refused", "handshakes_failed"}
    )

    name: str
    requests_in: int
    handler_errors: int
    deadlines_in: int
    calls_out: int
    casts_out: int
    streams_out: int
    deadlines_out: int
    stray_frames: int
    connection_errors: int
    connections_in: int
    connections_out: int
    waiting_calls: int
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    mailbox: MailboxStatistics
    handlers: SlotStatistics
    connections: tuple[ConnectionStatistics, ...]
    # Requests run by a connection's reader task (mesh.server's eager path), and how many of
    # those suspended and so got a task of their own; the rest went through the mailbox.
    requests_eager: int = 0
    requests_handed_off: int = 0
    # Connections closed on arrival because max_connections were already being served.
    connections_refused: int = 0
    # Accepted connections closed in the handshake: no or a wrong membership proof (a peer
    # without the mesh's secret), another protocol version, or no Hello in time.
    handshakes_failed: int = 0
    # Pools of their own (`slots=N` at registration), beside `mailbox` and `handlers`.
    pools: tuple[PoolStatistics, ...] = ()


class Node:
    """One named actor: handlers, a bounded mailbox, workers, listeners and peer links."""

    def __init__(
        self,
        name: str,
        codec: Codec,
        transport: Transport,
        resolve: Callable[[str], Address] | Mapping[str, Address],
        config: NodeConfig | None = None,
        *,
        secret: bytes | None = None,
        require_secret_beyond_loopback: bool = False,
    ) -> None:
        """`secret`: the mesh's shared secret (>= 16 bytes); when set, every connection either
        way proves membership in its handshake (mesh.membership) and peers without it are
        refused. `require_secret_beyond_loopback`: `listen` on a non-loopback host without a
        secret raises ConfigError."""
        self.name = name
        self.codec = codec
        self.config = config or NodeConfig()
        self.address: Address | None = None
        self._transport = transport
        self._secret = check_secret(secret)
        self._require_secret = require_secret_beyond_loopback
        resolver = resolve.__getitem__ if isinstance(resolve, Mapping) else resolve
        self._peers = Peers(name, codec, transport, resolver, self.config, self._secret)
        self._handlers = Handlers(codec.messages)
        self._pools: Pools[Request] = Pools(self.config.mailbox_size,
                                            self.config.max_concurrency)
        self._mailbox: Mailbox[Request] = self._pools.shared.mailbox
        self._slots: Slots = self._pools.shared.slots
        self._stack: AsyncExitStack | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._incoming = Incoming(name, codec, self.config, self._secret, self._session_for)
        # anyio's clock until the node runs, then the loop's own (same time, no lookup).
        self.now: Callable[[], float] = anyio.current_time

    def handles(self, message: type[M], *, slots: int | None = None
                ) -> Callable[[UnaryHandler[M]], UnaryHandler[M]]:
        """Registers `async def h(msg, ctx) -> reply | None` for `call` and `cast`; with
        `slots`, its requests run in a pool of their own of that many slots."""
        return self._registrar(self._handlers.unary, message, slots)

    def serves_stream(self, message: type[M], *, slots: int | None = None
                      ) -> Callable[[StreamHandler[M]], StreamHandler[M]]:
        """Registers an async generator `h(msg, ctx)` whose items `open_stream` reads."""
        check_slots(message, slots)
        return self._registrar(self._handlers.streams, message, slots)

    def accepts_stream(self, message: type[M], *, slots: int | None = None
                       ) -> Callable[[UploadHandler[M]], UploadHandler[M]]:
        """Registers `async def h(first, items, ctx) -> reply | None` for `stream_to`."""
        check_slots(message, slots)
        return self._registrar(self._handlers.uploads, message, slots)

    def _registrar(self, table: dict[type[Any], H], message: type[M], slots: int | None
                   ) -> Callable[[H], H]:
        """The decorator that enters a handler in `table` for `message` and reserves its
        pool."""

        def register(handler: H) -> H:
            self._handlers.add(table, message, handler)
            self._reserve(message, slots)
            return handler

        return register

    def _reserve(self, message: type[msgspec.Struct], slots: int | None) -> None:
        """Gives `message` a pool of `slots` handler slots and workers (None: the shared)."""
        pool = self._pools.reserve(message, slots)
        if pool is not None and self._group is not None:
            self._start_workers(pool)

    def pool_for(self, message: type[msgspec.Struct]) -> Pool[Request]:
        """The pool requests of type `message` queue and run in."""
        return self._pools.pool_for(message)

    def _start_workers(self, pool: Pool[Request]) -> None:
        """Lets `pool` start its worker tasks in the node's group as requests arrive."""
        group = self._group
        assert group is not None
        pool.run_workers(lambda: native.start_soon(group, self._work, pool))

    async def __aenter__(self) -> Node:
        if self._stack is not None:
            raise MeshError(f"node {self.name!r} is already running")
        self.now = native.clock()
        self._stack = AsyncExitStack()
        self._group = await self._stack.enter_async_context(anyio.create_task_group())
        self._group.start_soon(self._peers.watch.run)
        for pool in self._pools.all():
            self._start_workers(pool)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._stack is not None and self._group is not None
        self._group.cancel_scope.cancel()
        try:
            return await self._stack.__aexit__(kind, exc, tb)
        except BaseExceptionGroup as group:
            # The body's own exception alone in the group: re-raise it bare, as it was thrown.
            if exc is None or group.exceptions != (exc,):
                raise
        finally:
            self._stack = self._group = None
            for pool in self._pools.all():
                pool.run_workers(None)
                pool.mailbox.close()
        raise exc

    async def serve(
        self, address: Address | None = None, *, task_status: anyio.abc.TaskStatus[Address] = (
            anyio.TASK_STATUS_IGNORED)
    ) -> None:
        """Runs the node and listens until cancelled; `await tg.start(node.serve)` -> address."""
        async with self:
            task_status.started(await self.listen(address))
            await anyio.sleep_forever()

    async def listen(self, address: Address | None = None) -> Address:
        """Accepts peers at `address` (default: this node's own name resolved); bound address."""
        group = self._running("listen")
        address = address or self._peers.address_of(self.name)
        if self._require_secret:
            require_secret_beyond_loopback(address.host, self._secret)
        bound = await self._transport.listen(address)
        group.start_soon(self._accept, bound.listener)
        self.address = bound.address
        log.info("node %s listening on %s", self.name, bound.address)
        return bound.address

    @overload
    async def call(
        self,
        peer: str,
        message: msgspec.Struct,
        expect: None = None,
        *,
        timeout: float | None = None,
    ) -> msgspec.Struct | None: ...

    @overload
    async def call(
        self, peer: str, message: msgspec.Struct, expect: type[R], *, timeout: float | None = None
    ) -> R: ...

    async def call(
        self,
        peer: str,
        message: msgspec.Struct,
        expect: type[R] | None = None,
        *,
        timeout: float | None = None,
    ) -> msgspec.Struct | None:
        """Request/reply; DeadlineExceeded, RemoteError, PeerGone or UnexpectedReply on failure.

        `timeout` in seconds (default `config.call_timeout`; `math.inf` for none).
        """
        seconds = self._timeout(timeout)
        deadline = self.now() + seconds
        self._peers.counts.calls += 1
        session = self._peers.live(peer) or await self._session(peer, deadline)
        relative = wire_timeout(seconds)
        what = f"call {type(message).__name__} to {peer}"
        answer = await session.call(message, deadline, relative, what)
        result = unwrap(answer, peer)
        if expect is not None and not isinstance(result, expect):
            got = type(result).__name__
            raise UnexpectedReply(f"{peer} answered {type(message).__name__} with {got}, "
                                  f"expected {expect.__name__}")
        return result

    async def cast(
        self, peer: str, message: msgspec.Struct, *, timeout: float | None = None
    ) -> None:
        """One-way send; returns once the frame is queued (the deadline bounds backpressure)."""
        deadline = self._deadline(timeout)
        self._peers.counts.casts += 1
        await (await self._session(peer, deadline)).cast(message, deadline)

    @asynccontextmanager
    async def open_stream(
        self, peer: str, message: msgspec.Struct, *, timeout: float | None = None
    ) -> AsyncIterator[StreamReader]:
        """`async with node.open_stream(p, m) as items: async for item in items:`.

        The deadline covers the whole stream; leaving early tells the server to stop.
        """
        deadline = self._deadline(timeout)
        self._peers.counts.streams += 1
        session = await self._session(peer, deadline)
        async with session.open_stream(message, deadline) as reader:
            yield reader

    @asynccontextmanager
    async def stream_to(
        self, peer: str, message: msgspec.Struct, *, timeout: float | None = None
    ) -> AsyncIterator[StreamSink]:
        """`async with node.stream_to(p, first) as sink: await sink.send(item)`.

        End on exit, then waits for the handler's reply (`sink.result`); Abort if the body
        raises, or if the sender is cancelled before that reply. The deadline covers the
        whole stream.
        """
        deadline = self._deadline(timeout)
        self._peers.counts.streams += 1
        session = await self._session(peer, deadline)
        async with session.push_stream(message, deadline) as sink:
            yield sink

    def statistics(self) -> NodeStatistics:
        clients = self._peers.sessions()
        links = [s.conn.statistics() for s in clients] + [
            s.conn.statistics() for s in self._incoming.sessions]
        total = [self._incoming.retired, self._peers.retired, *links]
        counts, out = self._handlers.counts, self._peers.counts
        return NodeStatistics(
            name=self.name,
            requests_in=counts.requests,
            handler_errors=counts.handler_errors,
            deadlines_in=counts.deadlines,
            calls_out=out.calls,
            casts_out=out.casts,
            streams_out=out.streams,
            deadlines_out=out.deadlines,
            stray_frames=counts.stray_frames + out.stray + sum(s.stray_frames for s in clients),
            connection_errors=counts.connection_errors + self._incoming.failed_handshakes,
            connections_in=len(self._incoming.sessions),
            connections_out=sum(s.alive for s in clients),
            waiting_calls=sum(s.waiting for s in clients),
            frames_in=sum(c.frames_in for c in total),
            frames_out=sum(c.frames_out for c in total),
            bytes_in=sum(c.bytes_in for c in total),
            bytes_out=sum(c.bytes_out for c in total),
            mailbox=self._mailbox.statistics(),
            handlers=self._slots.statistics(),
            connections=tuple(links),
            requests_eager=counts.eager,
            requests_handed_off=counts.handed_off,
            connections_refused=self._incoming.refused,
            handshakes_failed=self._incoming.failed_handshakes,
            pools=tuple(pool.statistics() for pool in self._pools.own()),
        )

    def check_integrity(self) -> None:
        """Asserts the invariants of the mailbox, every connection and the deadline watch."""
        for pool in self._pools.all():
            pool.check_integrity()
        self._peers.watch.check_integrity()
        for session in self._peers.sessions():
            session.conn.check_integrity()
        for server in self._incoming.sessions:
            server.conn.check_integrity()
            server.check_integrity()

    def _running(self, what: str) -> anyio.abc.TaskGroup:
        if self._group is None:
            raise MeshError(f"node {self.name!r}: {what} needs `async with node:` first")
        return self._group

    def _deadline(self, timeout: float | None) -> float:
        return self.now() + self._timeout(timeout)

    def _timeout(self, timeout: float | None) -> float:
        seconds = self.config.call_timeout if timeout is None else timeout
        if not seconds >= 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout}")
        return seconds

    async def _session(self, peer: str, deadline: float) -> ClientSession:
        group = self._running(f"talking to {peer!r}")
        return await self._peers.session(peer, deadline, group)

    async def _work(self, pool: Pool[Request]) -> None:
        pool.worker_ready()
        async for request in pool.mailbox:
            await pool.slots.take()
            try:
                await self._handlers.run(request)
            finally:
                pool.slots.give()

    async def _accept(self, listener: anyio.abc.Listener[anyio.abc.ByteStream]) -> None:
        async with listener:
            await listener.serve(self._incoming.serve, self._group)

    def _session_for(self, conn: Connection) -> ServerSession:
        group = self._running("serving")
        return ServerSession(self.now, conn, self.pool_for, self._handlers,
                             lambda work: native.start_soon(group, work))
