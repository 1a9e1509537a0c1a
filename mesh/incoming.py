"""Incoming: a node's accepted connections, the counterpart of its peers (mesh.peers).

An accepted stream is admitted while fewer than `max_connections` are open (else closed at
once and counted as refused), must finish the handshake within `handshake_timeout` (proving
membership when the mesh has a secret), and is then served by a `ServerSession` until the
peer leaves. A session's traffic is added to `retired` when it ends, so that a node's totals
never go down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc

from mesh.config import NodeConfig
from mesh.connection import Connection, ConnectionStatistics, add_traffic, server_handshake
from mesh.errors import MeshError
from mesh.server import ServerSession
from mesh.wire import Codec

log = logging.getLogger(__name__)


class Incoming:
    """The server sessions of one node; `serve` is the listener's handler."""

    def __init__(self, name: str, codec: Codec, config: NodeConfig, secret: bytes | None,
                 session_for: Callable[[Connection], ServerSession]) -> None:
        self.name = name
        self.sessions: set[ServerSession] = set()
        self.retired = ConnectionStatistics("retired", 0, 0, 0, 0)
        self.refused = 0  # closed on arrival: max_connections were already open
        self.failed_handshakes = 0
        self._codec = codec
        self._config = config
        self._secret = secret
        self._session_for = session_for
        # Accepted streams in the handshake or served; bounded by config.max_connections.
        self._open = 0

    async def serve(self, stream: anyio.abc.ByteStream) -> None:
        """Serves an accepted stream, unless max_connections are already open."""
        if self._open >= self._config.max_connections:
            self.refused += 1
            log.warning("node %s refused a connection: max_connections=%d are open",
                        self.name, self._config.max_connections)
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            return
        self._open += 1
        try:
            await self._serve_admitted(stream)
        finally:
            self._open -= 1

    async def _serve_admitted(self, stream: anyio.abc.ByteStream) -> None:
        config = self._config
        conn = Connection(
            stream, self._codec, receive_size=config.receive_size, send_buffer=config.send_buffer
        )
        try:
            with anyio.fail_after(config.handshake_timeout):
                await server_handshake(conn, self.name, self._secret)
        except (MeshError, TimeoutError) as exc:
            self.failed_handshakes += 1
            log.warning("node %s refused a connection from %s: %r", self.name, conn.peer, exc)
            with anyio.CancelScope(shield=True):
                await conn.aclose()
            return
        session = self._session_for(conn)
        self.sessions.add(session)
        try:
            await session.run(config.stream_buffer)
        finally:
            self.sessions.discard(session)
            self.retired = add_traffic(self.retired, conn.statistics())
