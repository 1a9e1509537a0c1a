"""Transports: how a node reaches an address and accepts byte streams.

One small interface (`Transport`) with two implementations, so the same node code runs over
real loopback/LAN TCP (`TcpTransport`, anyio sockets) or entirely inside one event loop
(`MemoryTransport`, anyio memory object streams through a shared `MemoryHub`). The in-memory
one is what tests and the virtual-time simulation use: it does no real I/O, so trio's
MockClock can jump freely (docs/engineering-notes.md G1).

Both give anyio `ByteStream`s; framing lives above, in `mesh.connection`. The TCP streams are
mesh.tcp's, which skip the scheduler passes anyio's own socket streams spend per operation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from mesh import tcp
from mesh.errors import ConfigError
from mesh.mailbox import Mailbox
from mesh.tcp.listener import TcpListener, serve_streams

Chunk = bytes | bytearray


class Address(msgspec.Struct, frozen=True):
    """Where a node listens: host and port (for the memory transport, just a key)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class BoundListener:
    """A listener plus the address it really bound (port 0 asks for a free one)."""

    listener: anyio.abc.Listener[anyio.abc.ByteStream]
    address: Address


class Transport(Protocol):
    """Opens byte streams to addresses and listens on addresses."""

    async def connect(self, address: Address) -> anyio.abc.ByteStream:
        """A stream to `address`; OSError (e.g. ConnectionRefusedError) when nobody listens."""
        ...

    async def listen(self, address: Address) -> BoundListener:
        """Starts listening; the caller owns the listener and must close it."""
        ...


@dataclass(frozen=True)
class TcpTransport:
    """Real TCP (mesh.tcp streams, on trio or asyncio); Nagle off for request/reply latency."""

    async def connect(self, address: Address) -> anyio.abc.ByteStream:
        return await tcp.connect(address.host, address.port)

    async def listen(self, address: Address) -> BoundListener:
        await anyio.lowlevel.checkpoint()
        listener = TcpListener.bind(address.host, address.port)
        return BoundListener(listener, Address(address.host, listener.port))


class MemoryByteStream(anyio.abc.ByteStream):
    """One end of an in-memory byte pipe: it sends into one mailbox and receives from another.

    Chunks travel by reference (no copy): a sender must not change a buffer after sending it,
    the same rule uvloop imposes on sockets (docs/engineering-notes.md G8). `mesh.connection` never
    does.
    """

    # Writes are hand-offs in memory, not system calls: joining frames saves nothing
    # (mesh.outbox.InMemory).
    in_memory = True

    def __init__(self, outgoing: Mailbox[Chunk], incoming: Mailbox[Chunk]) -> None:
        self._outgoing = outgoing
        self._incoming = incoming
        self._leftover = b""
        self._closed = False
        self._peer: MemoryByteStream | None = None  # the other end (memory_pipe)
        self._consumer: Callable[[Chunk], bool] | None = None

    def deliver_to(self, consumer: Callable[[Chunk], bool] | None) -> None:
        """Offers each chunk the other end sends while none is queued here to `consumer`
        first, in the sending task; it returns False to leave the chunk queued for
        `receive`. The in-memory form of what mesh.tcp's asyncio stream does from the
        loop's callback: the reader task is not woken for a chunk it would only route."""
        self._consumer = consumer

    def _offer(self, item: Chunk) -> bool:
        """Whether the other end's consumer took `item` (see `deliver_to`)."""
        peer = self._peer
        if peer is None or peer._consumer is None or peer._closed or peer._leftover:
            return False
        return self._outgoing.empty and self._outgoing.open and peer._consumer(item)

    def send_nowait(self, item: Chunk) -> int:
        """Hands `item` over if the pipe has room now (or the other end's consumer takes
        it); the bytes taken: all, or none when the pipe is full."""
        if self._closed:
            raise anyio.ClosedResourceError
        if self._offer(item) or self._outgoing.put_nowait(item):
            return len(item)
        if not self._outgoing.open:
            raise anyio.BrokenResourceError("the other end of the memory pipe is closed")
        return 0

    async def send(self, item: Chunk) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._offer(item):
            return
        if not await self._outgoing.put(item):
            raise anyio.BrokenResourceError("the other end of the memory pipe is closed")

    def wake_reader(self) -> None:
        """Has the task waiting in `receive`, if one waits, return an empty chunk: the
        consumer took a chunk (`deliver_to`) but left something for that task to read
        (mesh.connection; a reader not waiting finds it before it waits). Only from within
        the consumer, which is offered chunks while none is queued, so the empty one always
        finds room."""
        if self._incoming.getters:
            self._incoming.put_nowait(b"")

    async def wait_readable(self) -> None:
        """Waits until `receive` would not wait (a chunk is queued, or the end), taking
        nothing: the chunk keeps its place in the pipe, and the room it takes there."""
        if self._closed:
            raise anyio.ClosedResourceError
        if not self._leftover:
            await self._incoming.wait()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            raise anyio.ClosedResourceError
        chunk = self._leftover or await self._incoming.get()
        if len(chunk) > max_bytes:
            self._leftover = bytes(chunk[max_bytes:])
            return bytes(chunk[:max_bytes])
        self._leftover = b""
        # Zero-copy: the receiver sees the sender's buffer (a bytes or a never-reused bytearray).
        return chunk  # type: ignore[return-value]

    async def send_eof(self) -> None:
        self._outgoing.end()

    async def aclose(self) -> None:
        self._closed = True
        self._outgoing.end()
        self._incoming.close()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return {}


def memory_pipe(buffer_chunks: int) -> tuple[MemoryByteStream, MemoryByteStream]:
    """Two connected ends; each direction holds at most `buffer_chunks` unread chunks."""
    a_to_b: Mailbox[Chunk] = Mailbox(buffer_chunks)
    b_to_a: Mailbox[Chunk] = Mailbox(buffer_chunks)
    a, b = MemoryByteStream(a_to_b, b_to_a), MemoryByteStream(b_to_a, a_to_b)
    a._peer, b._peer = b, a
    return a, b


class MemoryListener(anyio.abc.Listener[anyio.abc.ByteStream]):
    """Accepts in-memory connections made through a `MemoryHub` to one address."""

    def __init__(self, hub: MemoryHub, address: Address) -> None:
        self.address = address
        self._hub = hub
        self._backlog: Mailbox[MemoryByteStream] = Mailbox(hub.backlog)

    async def offer(self, stream: MemoryByteStream) -> None:
        """Queues a new server-side end; ConnectionRefusedError once the listener is closed."""
        if not await self._backlog.put(stream):
            raise ConnectionRefusedError(f"memory listener {self.address} is closed")

    async def serve(
        self,
        handler: Callable[[anyio.abc.ByteStream], Any],
        task_group: anyio.abc.TaskGroup | None = None,
    ) -> None:
        await serve_streams(self._backlog, handler, task_group)

    async def aclose(self) -> None:
        self._hub.unregister(self)
        self._backlog.close()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return {}


@dataclass
class MemoryHub:
    """The in-process 'network': listeners keyed by address. One per simulated world."""

    buffer_chunks: int = 16
    backlog: int = 128
    _listeners: dict[Address, MemoryListener] = field(default_factory=dict)
    _ports: itertools.count[int] = field(default_factory=lambda: itertools.count(49152))

    def register(self, address: Address) -> MemoryListener:
        if address.port == 0:
            address = Address(address.host, self._free_port(address.host))
        if address in self._listeners:
            raise ConfigError(f"address {address} is already bound in this MemoryHub")
        listener = MemoryListener(self, address)
        self._listeners[address] = listener
        return listener

    def unregister(self, listener: MemoryListener) -> None:
        if self._listeners.get(listener.address) is listener:
            del self._listeners[listener.address]

    async def connect(self, address: Address) -> MemoryByteStream:
        listener = self._listeners.get(address)
        if listener is None:
            raise ConnectionRefusedError(f"nothing listens on memory address {address}")
        client, server = memory_pipe(self.buffer_chunks)
        await listener.offer(server)
        return client

    def _free_port(self, host: str) -> int:
        while True:
            port = next(self._ports)
            if Address(host, port) not in self._listeners:
                return port


@dataclass(frozen=True)
class MemoryTransport:
    """Connects and listens through a shared `MemoryHub` (pass the same hub to every node)."""

    hub: MemoryHub

    async def connect(self, address: Address) -> anyio.abc.ByteStream:
        return await self.hub.connect(address)

    async def listen(self, address: Address) -> BoundListener:
        await anyio.lowlevel.checkpoint()
        listener = self.hub.register(address)
        return BoundListener(listener, listener.address)
