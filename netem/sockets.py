"""Non-blocking TCP sockets driven directly by anyio, as the link's proxy uses them:
connecting and listening, and `SocketChannel`, the `ByteChannel` its pump moves bytes over.

`anyio.wait_readable` / `wait_writable` with `recv_into` a caller's buffer, not anyio's byte
streams, which allocate a `bytes` per receive (docs/engineering-notes.md G3). Tests drive the
pump over in-memory channels of the same protocol (tests/netem_channels.py).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Protocol

import anyio
import anyio.lowlevel

from mesh.tcp import connect_socket


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



def configure(sock: socket.socket) -> socket.socket:
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
        await connect_socket(configure(sock), address, f"{host}:{port}")
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
