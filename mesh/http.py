"""Serving an ASGI app next to the mesh: one listening socket, hypercorn, an orderly stop.

Every HTTP surface of the project (the router's API, the dashboard, the link's control API,
`/metrics`) is served the same way: bind the socket first (port 0 picks a free one, read back
from the socket, so tests never race for a port), hand hypercorn a duplicate of it, report the
bound address, and serve until the caller's scope is cancelled. Hypercorn runs on whichever
loop is current (trio in tests and simulation, asyncio with uvloop live). Listening sockets
stay this process's own: a child it starts (the supervisor's services) never holds its ports.
Request bodies are bounded (`BodyLimit`): one longer than `max_body_bytes` is refused with 413
before the app reads it, and one of unstated length (chunked) with 411.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import hypercorn.asyncio
import hypercorn.trio
import sniffio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

BACKLOG = 128
GRACE_S = 1.0
# hypercorn closes a keep-alive connection idle this long (its default, said here). A client
# must drop its idle connections sooner (CLIENT_KEEPALIVE_S as httpx's keepalive_expiry): one
# reused just as the server closes it fails with "Server disconnected without sending a
# response" (seen in `make chaos`, posting to the link's control API after a 5 s fault).
KEEP_ALIVE_S = 5.0
CLIENT_KEEPALIVE_S = 2.0
# The longest request body any HTTP surface takes: a prompt of 128K token ids as JSON is
# about 1 MiB; the admin and control APIs take a few hundred bytes.
MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: 413 for a declared Content-Length over `limit`, 411 for a body of
    unstated length (the server checks that a declared length is the body's length)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            if b"transfer-encoding" in headers:
                await _refuse(send, 411, "a request body needs a Content-Length")
                return
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                await _refuse(send, 413, f"request body over {self.limit} bytes")
                return
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = f'{{"error": "{message}", "status": {status}}}'.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: an ephemeral one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _OwnSocketsConfig(HypercornConfig):
    """hypercorn's config without its inheritable sockets (meant for worker processes of its
    own): uvloop does not close a child's inherited descriptors, so every process spawned
    after hypercorn starts would otherwise hold the port, and keep it after this one dies."""

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets, *sockets.quic_sockets):
            sock.set_inheritable(False)
        return sockets


def _config(sock: socket.socket, log_name: str) -> HypercornConfig:
    config = _OwnSocketsConfig()
    # hypercorn owns (and closes) a duplicate of the socket; the caller closes its own.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(log_name)
    config.graceful_timeout = GRACE_S
    config.keep_alive_timeout = KEEP_ALIVE_S
    return config


async def _serve(app: Any, config: HypercornConfig, stop: anyio.Event) -> None:
    serve: Callable[..., Awaitable[None]] = (
        hypercorn.trio.serve if sniffio.current_async_library() == "trio"
        else hypercorn.asyncio.serve
    )
    # Shielded so that a cancelled caller still shuts hypercorn down in order (stop below).
    with anyio.CancelScope(shield=True):
        await serve(app, config, shutdown_trigger=stop.wait)


async def serve_http(
    app: Any,
    host: str,
    port: int,
    *,
    log_name: str = "mesh.http",
    before_stop: Callable[[], None] = lambda: None,
    max_body_bytes: int = MAX_BODY_BYTES,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serves `app` on host:port until cancelled; reports the bound (host, port) once listening.
    Request bodies over `max_body_bytes` are refused (`BodyLimit`).

    `before_stop` runs first on the way out (e.g. ending open event streams, so that they
    finish within hypercorn's grace period)."""
    stop = anyio.Event()
    with listen(host, port) as sock:
        bound = sock.getsockname()[:2]
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve, BodyLimit(app, max_body_bytes), _config(sock, log_name),
                          stop)
            task_status.started((str(bound[0]), int(bound[1])))
            try:
                await anyio.sleep_forever()
            finally:
                before_stop()
                stop.set()
