"""The mesh's TCP stream on trio: a non-blocking socket and trio's lowlevel waits (how it
waits, and why: the package docstring, `mesh.tcp`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import trio

from mesh.tcp.sockets import BULK_READ, attributes, tune

_A = TypeVar("_A")
_T = TypeVar("_T")

FAIR_READS = 16
# Reads start at this size and grow to the caller's max only while the data keeps coming:
# asking for 1 MiB to get 200 bytes costs an mmap and munmap per read under glibc's default
# allocator settings (13 us on the 2-vCPU host; docs/engineering-notes.md G3).
SMALL_READ = 64 * 1024


class TrioSocketStream(anyio.abc.ByteStream):
    """A connected non-blocking socket driven with trio's lowlevel waits."""

    def __init__(self, sock: socket.socket) -> None:
        tune(sock)
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
        return self._send_some(self._sock.send, data)

    async def send(self, item: bytes) -> None:
        sent = self._send_some(self._sock.send, item)
        if sent < len(item):
            view = memoryview(item)
            while sent < len(item):
                await self._wait(trio.lowlevel.wait_writable)
                sent += self._send_some(self._sock.send, view[sent:])

    async def send_parts(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Writes the buffers in order, as one stream of bytes, with gathering writes
        (sendmsg): no buffer is copied or joined in user space."""
        views = [memoryview(part) for part in parts]
        while True:
            sent = self._send_some(self._sock.sendmsg, views)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if not views:
                return
            views[0] = views[0][sent:]
            await self._wait(trio.lowlevel.wait_writable)

    def send_parts_nowait(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        """One gathering write of what the socket takes now, without waiting; the bytes."""
        return self._send_some(self._sock.sendmsg, parts)

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
        return attributes(self._sock)

    def _send_some(self, write: Callable[[_A], int], data: _A) -> int:
        """write(data) (send or sendmsg) now: the bytes the socket took, 0 if none."""
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            return write(data)
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
