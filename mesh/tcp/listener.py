"""The listening side of the mesh's own TCP streams (`mesh.tcp`): accept, then wrap."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from mesh.tcp import wrap_socket


async def serve_streams(
    streams: AsyncIterator[anyio.abc.ByteStream],
    handler: Callable[[anyio.abc.ByteStream], Any],
    task_group: anyio.abc.TaskGroup | None,
) -> None:
    """A listener's `serve`: `handler(stream)` in a task of `task_group` (None: a group of
    its own) for each stream accepted, until `streams` ends."""
    async with anyio.create_task_group() as own_group:
        group = task_group or own_group
        async for stream in streams:
            group.start_soon(handler, stream)


class TcpListener(anyio.abc.Listener[anyio.abc.ByteStream]):
    """Accepts connections on a listening socket and hands each one over as a fast stream."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._closed = False

    @classmethod
    def bind(cls, host: str, port: int) -> TcpListener:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        return cls(sock)

    @property
    def port(self) -> int:
        port: int = self._sock.getsockname()[1]
        return port

    async def serve(
        self,
        handler: Callable[[anyio.abc.ByteStream], Any],
        task_group: anyio.abc.TaskGroup | None = None,
    ) -> None:
        await serve_streams(self._accepted(), handler, task_group)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            anyio.notify_closing(self._sock)
            self._sock.close()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return {
            anyio.abc.SocketAttribute.raw_socket: lambda: self._sock,
            anyio.abc.SocketAttribute.local_address: self._sock.getsockname,
            anyio.abc.SocketAttribute.local_port: lambda: self.port,
        }

    async def _accepted(self) -> AsyncIterator[anyio.abc.ByteStream]:
        while True:
            yield await self._accept()

    async def _accept(self) -> anyio.abc.ByteStream:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                await anyio.wait_readable(self._sock)
                continue
            return await wrap_socket(sock)
