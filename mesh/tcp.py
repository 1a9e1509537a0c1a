"""TCP byte streams that cost one scheduler pass per wait, not one per operation.

`TcpTransport` (mesh.transport) opens and accepts these instead of anyio's socket streams.
anyio's streams are correct but pay for every operation: on trio each successful `recv` and
`send` ends with a forced yield (trio's fairness checkpoint), and on asyncio every receive
resumes and then pauses the transport's reading (two epoll_ctl calls) and every send awaits a
checkpoint. A request/reply round trip does four such operations per side. Measured on the
2-vCPU host, echoing 200-byte frames to a blocking client, CPU per round trip on the server:
anyio 20 us on trio and 23 us on uvloop; these streams 12 us and 11 us; blocking sockets 8 us.

* trio: a non-blocking socket. `send` writes at once and waits (`wait_writable`) only for the
  part the kernel did not take; `receive` waits (`wait_readable`) only when the last read
  drained the socket, so the common case is one wait and one read. Reads that find data at
  once do not yield; every FAIR_READS-th of them in a row does, so one busy peer cannot
  starve the other tasks.
* asyncio (uvloop or not): a Protocol that keeps reading on, queues the chunks it is given and
  wakes the one reader through a future; reading pauses while more than READ_BUFFER bytes
  wait unread (backpressure to the peer), and `send` waits only while the transport has
  paused writing.

Both also write several buffers as one (`send_parts`, or `send_parts_nowait` for what the
socket takes at once: a frame cut around its bulk payload, mesh.wire.Codec.encode_parts)
without joining them, and read the rest of a bulk frame straight into its own buffer
(mesh.parser.FrameParser.into), BULK_READ bytes at a time: trio's `receive_into`, asyncio's
`fill_into`.
Neither `send` nor `receive` is a checkpoint when it need not wait: callers loop around real
waits (mesh.connection's readers and writer do). Errors follow anyio's streams: EndOfStream
at the peer's end, BrokenResourceError for a reset or refused write, ClosedResourceError after
our own `aclose`.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

import anyio
import anyio.abc
import anyio.lowlevel
import trio

from mesh.native import on_asyncio

_A = TypeVar("_A")
_T = TypeVar("_T")

FAIR_READS = 16
# Reads start at this size and grow to the caller's max only while the data keeps coming:
# asking for 1 MiB to get 200 bytes costs an mmap and munmap per read under glibc's default
# allocator settings (13 us on the 2-vCPU host; docs/engineering-notes.md G3).
SMALL_READ = 64 * 1024
READ_BUFFER = 4 * 1024 * 1024
# The rest of a bulk frame is read into its buffer this much at a time. Reading loopback TCP
# in steps of 64 KiB made the *sender* cheaper per byte than reading up to 1 MiB at once, and
# the reader too: a blocking sender to a blocking `recv_into`, 4.9 against 4.0 GB/s; the mesh
# on trio 4.95 against 3.15, on uvloop 4.67 against 3.31, sender and receiver CPU per GiB
# both lower (docs/engineering-notes.md 3a).
BULK_READ = 64 * 1024
# The asyncio protocol's read buffer, copied out per read (uvloop's own is this size).
SCRATCH = 256 * 1024
WRITE_BUFFER = 256 * 1024


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Nagle would hold a small reply back until the previous segment is acknowledged.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _attributes(sock: socket.socket) -> dict[Any, Callable[[], Any]]:
    attribute = anyio.abc.SocketAttribute
    return {
        attribute.raw_socket: lambda: sock,
        attribute.family: lambda: sock.family,
        attribute.local_address: sock.getsockname,
        attribute.remote_address: sock.getpeername,
    }


class TrioSocketStream(anyio.abc.ByteStream):
    """A connected non-blocking socket driven with trio's lowlevel waits."""

    def __init__(self, sock: socket.socket) -> None:
        _tune(sock)
        self._sock = sock
        self._closed = False
        self._drained = True
        self._fast_reads = 0
        self._last_read = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        size = max_bytes if self._last_read >= SMALL_READ else min(max_bytes, SMALL_READ)
        data = await self._read(self._sock.recv, size)
        self._count_read(len(data), size)
        return data

    async def receive_into(self, buffer: memoryview) -> int:
        """Reads straight into `buffer` (mesh.connection: a bulk frame's own memory); how
        many bytes, at least one and at most BULK_READ. The next `receive` starts small
        again: what follows a bulk frame is read into a new chunk, so the less of the next
        one it holds, the better."""
        step = buffer[:BULK_READ]
        count: int = await self._read(self._sock.recv_into, step)
        self._count_read(count, len(step))
        self._last_read = 0
        return count

    async def _read(self, read: Callable[[_A], _T], argument: _A) -> _T:
        """read(argument) once the socket has data; the waits and fairness of `receive`."""
        if self._closed:
            raise anyio.ClosedResourceError
        wait = self._drained
        if not wait and self._fast_reads >= FAIR_READS:
            self._fast_reads = 0
            await trio.lowlevel.checkpoint()
        while True:
            if wait:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError:
                    raise anyio.ClosedResourceError from None
            try:
                return read(argument)
            except BlockingIOError:
                wait = True
            except OSError as exc:
                raise self._broken(exc) from exc

    def _count_read(self, count: int, asked: int) -> None:
        if not count:
            raise anyio.EndOfStream
        # A short read emptied the socket: next time, wait first instead of a failing recv.
        self._last_read = count
        self._drained = count < asked
        self._fast_reads = 0 if self._drained else self._fast_reads + 1

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Writes what the socket takes now, without waiting; how many bytes that was."""
        return self._send_some(data)

    async def send(self, item: bytes) -> None:
        sent = self._send_some(item)
        if sent < len(item):
            view = memoryview(item)
            while sent < len(item):
                await self._wait(trio.lowlevel.wait_writable)
                sent += self._send_some(view[sent:])

    async def send_parts(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Writes the buffers in order, as one stream of bytes, with gathering writes
        (sendmsg): no buffer is copied or joined in user space."""
        views = [memoryview(part) for part in parts]
        while True:
            sent = self._send_parts_some(views)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if not views:
                return
            views[0] = views[0][sent:]
            await self._wait(trio.lowlevel.wait_writable)

    def send_parts_nowait(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        """One gathering write of what the socket takes now, without waiting; the bytes."""
        return self._send_parts_some(parts)

    def _send_parts_some(
        self, parts: tuple[bytes | bytearray | memoryview, ...] | list[memoryview]
    ) -> int:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            return self._sock.sendmsg(parts)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._broken(exc) from exc

    async def send_eof(self) -> None:
        if not self._closed:
            self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        await trio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return _attributes(self._sock)

    def _send_some(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._broken(exc) from exc

    async def _wait(self, wait: Callable[[socket.socket], Any]) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            await wait(self._sock)
        except trio.ClosedResourceError:
            raise anyio.ClosedResourceError from None

    def _broken(self, exc: OSError) -> Exception:
        if self._closed:
            return anyio.ClosedResourceError()
        return anyio.BrokenResourceError(f"socket error: {exc!r}")


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
        _tune(sock)
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
        protocol = self._protocol
        if self._closed or protocol.lost is not None or self._transport.is_closing():
            self._check_writable()
        if protocol.writing_paused:
            return 0
        self._transport.write(data)
        return len(data)

    async def send(self, item: bytes) -> None:
        protocol = self._protocol
        if self._closed or protocol.lost is not None or self._transport.is_closing():
            self._check_writable()
        self._transport.write(item)
        await self._drain()

    async def send_parts(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Writes the buffers in order, as one stream of bytes (uvloop: one gathering write,
        nothing joined)."""
        protocol = self._protocol
        if self._closed or protocol.lost is not None or self._transport.is_closing():
            self._check_writable()
        self._transport.writelines(parts)
        await self._drain()

    def send_parts_nowait(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        """Hands the buffers to the transport unless it has paused writing; the bytes it
        took (all or none)."""
        protocol = self._protocol
        if self._closed or protocol.lost is not None or self._transport.is_closing():
            self._check_writable()
        if protocol.writing_paused:
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
        return {} if sock is None else _attributes(sock)

    def _check_readable(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        lost = self._protocol.lost
        if lost is not None:
            raise anyio.BrokenResourceError(f"socket error: {lost!r}") from lost
        if self._protocol.eof:
            raise anyio.EndOfStream

    def _check_writable(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        lost = self._protocol.lost
        if lost is not None or self._transport.is_closing():
            raise anyio.BrokenResourceError(f"connection lost: {lost!r}")


async def wrap_socket(sock: socket.socket) -> anyio.abc.ByteStream:
    """The fast stream for a connected socket, for the backend that runs this task."""
    if on_asyncio():
        return await AsyncioSocketStream.wrap(sock)
    return TrioSocketStream(sock)


async def connect(host: str, port: int) -> anyio.abc.ByteStream:
    """Connects to the first address of `host` that accepts; OSError if none does."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            await connect_socket(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return await wrap_socket(sock)
    raise error


async def connect_socket(sock: socket.socket, address: Any, name: str | None = None) -> None:
    """Connects `sock` (made non-blocking) to `address`; OSError naming `name` (else the
    address) if it cannot."""
    sock.setblocking(False)
    code = sock.connect_ex(address)
    if code == errno.EINPROGRESS:
        await anyio.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, f"connect to {name or address}: {os.strerror(code)}")
