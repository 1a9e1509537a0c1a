"""The mesh's TCP stream on asyncio, uvloop or not: a transport and its buffered protocol
(how it reads and waits, and why: the package docstring, `mesh.tcp`)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel

from mesh.tcp.sockets import BULK_READ, attributes, tune

READ_BUFFER = 4 * 1024 * 1024
# The protocol's read buffer, copied out per read (uvloop's own is this size).
SCRATCH = 256 * 1024
WRITE_BUFFER = 256 * 1024


_SCRATCH = threading.local()


def _scratch() -> bytearray:
    """The read buffer of this thread's loop, shared by its connections (the loop fills one
    and `buffer_updated` copies it out before it reads again); one per connection grew the
    services' memory by 256 KiB for each peer connected at once."""
    buffer: bytearray | None = getattr(_SCRATCH, "buffer", None)
    if buffer is None:
        buffer = _SCRATCH.buffer = bytearray(SCRATCH)
    return buffer


class _StreamProtocol(asyncio.BufferedProtocol):
    """Queues received chunks for one reader; tracks the transport's write pauses.

    A buffered protocol: the loop reads into the buffer `get_buffer` returns. While nothing
    is queued and the reader has named a place for the next bytes (`fill_into`: the rest of
    a bulk frame), that place; else a scratch buffer, copied out as a chunk (what uvloop
    does itself for a plain protocol).
    """

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.into: Callable[[], memoryview | None] | None = None
        self.filled: Callable[[int], bool] | None = None
        self._reading_into = False
        self.buffered = 0
        self.eof = False
        self.lost: Exception | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.reader: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.consumer: Callable[[bytes], bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(WRITE_BUFFER)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self.into is not None and not self.chunks:
            target = self.into()
            if target is not None:
                self._reading_into = True
                return target[:BULK_READ]
        self._reading_into = False
        return _scratch()

    def buffer_updated(self, nbytes: int) -> None:
        if self._reading_into:
            self._reading_into = False
            assert self.filled is not None
            if self.filled(nbytes):
                # An empty chunk: the reader looks again (frames are ready, or an error).
                self.chunks.append(b"")
                self.wake_reader()
            return
        self.data_received(bytes(memoryview(_scratch())[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self.consumer is not None and not self.chunks and self.consumer(data):
            return
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > READ_BUFFER and not self.reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self.reading_paused = True
        self.wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self.wake_reader()
        # Keep our half open: the peer may still read what we send.
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.lost = exc
        self.wake_reader()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        writer, self.writer = self.writer, None
        if writer is not None and not writer.done():
            writer.set_result(None)

    def wake_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)


class AsyncioSocketStream(anyio.abc.ByteStream):
    """A connected socket driven by an asyncio transport and `_StreamProtocol`."""

    def __init__(self, transport: asyncio.Transport, protocol: _StreamProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False

    @classmethod
    async def wrap(cls, sock: socket.socket) -> AsyncioSocketStream:
        """Hands a connected socket to the running loop (uvloop's or the stdlib's)."""
        tune(sock)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_accepted_socket(_StreamProtocol, sock)
        return cls(transport, protocol)

    def deliver_to(self, consumer: Callable[[bytes], bool] | None) -> None:
        """Offers each chunk that arrives while none is queued to `consumer` first, from the
        loop's callback; it returns False to leave the chunk queued for `receive`."""
        self._protocol.consumer = consumer

    def fill_into(self, into: Callable[[], memoryview | None] | None,
                  filled: Callable[[int], bool] | None) -> None:
        """Lets the reader name where the next bytes go: `into()` gives a view (or None for
        a chunk as usual), read into while no chunk is queued; `filled(n)` then says how many
        landed there and returns True to have the reader woken (`receive` then returns an
        empty chunk). None turns this off."""
        self._protocol.into = into
        self._protocol.filled = filled

    async def receive(self, max_bytes: int = 65536) -> bytes:
        protocol = self._protocol
        while not protocol.chunks:
            self._check_readable()
            protocol.reader = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                protocol.reader = None
        if self._closed:
            raise anyio.ClosedResourceError
        chunk = protocol.chunks.popleft()
        if len(chunk) > max_bytes:
            protocol.chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        protocol.buffered -= len(chunk)
        if protocol.reading_paused and protocol.buffered <= READ_BUFFER // 2:
            protocol.reading_paused = False
            self._transport.resume_reading()
        return chunk

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Hands `data` to the transport unless it has paused writing; the bytes it took."""
        if self._writing_paused():
            return 0
        self._transport.write(data)
        return len(data)

    async def send(self, item: bytes) -> None:
        self._check_writable()
        self._transport.write(item)
        await self._drain()

    async def send_parts(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Writes the buffers in order, as one stream of bytes (uvloop: one gathering write,
        nothing joined)."""
        self._check_writable()
        self._transport.writelines(parts)
        await self._drain()

    def send_parts_nowait(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        """Hands the buffers to the transport unless it has paused writing; the bytes it
        took (all or none)."""
        if self._writing_paused():
            return 0
        self._transport.writelines(parts)
        return sum(len(part) for part in parts)

    async def _drain(self) -> None:
        protocol = self._protocol
        while protocol.writing_paused:
            protocol.writer = waiter = asyncio.get_running_loop().create_future()
            await waiter
            self._check_writable()

    async def send_eof(self) -> None:
        if not self._transport.is_closing():
            self._transport.write_eof()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.close()
            self._protocol.wake_reader()
            self._protocol.resume_writing()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        sock = self._transport.get_extra_info("socket")
        return {} if sock is None else attributes(sock)

    def _check_readable(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        lost = self._protocol.lost
        if lost is not None:
            raise anyio.BrokenResourceError(f"socket error: {lost!r}") from lost
        if self._protocol.eof:
            raise anyio.EndOfStream

    def _writing_paused(self) -> bool:
        """Whether the transport has paused writing (raises where nothing can be written)."""
        self._check_writable()
        return self._protocol.writing_paused

    def _check_writable(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        lost = self._protocol.lost
        if lost is not None or self._transport.is_closing():
            raise anyio.BrokenResourceError(f"connection lost: {lost!r}")
