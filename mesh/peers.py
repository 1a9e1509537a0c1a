"""Peers: a node's outgoing links, one client session per peer name.

A session is dialled on first use (resolve the name, connect, handshake, check that the peer
answering is the one asked for), cached, and dropped when its connection ends, so the next
use redials: a restarted peer is found again without anyone noticing but the calls that were
in flight, which fail with PeerGone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc

from mesh.client import ClientSession
from mesh.config import NodeConfig
from mesh.connection import Connection, ConnectionStatistics, add_traffic, client_handshake
from mesh.deadlines import DeadlineWatch, deadline_scope
from mesh.errors import HandshakeError, PeerGone, UnknownPeer
from mesh.transport import Address, Transport
from mesh.wire import Codec

log = logging.getLogger(__name__)


@dataclass
class OutCounts:
    """What a node asked of its peers (mutable; NodeStatistics copies it)."""

    calls: int = 0
    casts: int = 0
    streams: int = 0
    deadlines: int = 0
    stray: int = 0

    def count_deadline(self) -> None:
        self.deadlines += 1


class Peers:
    """The client sessions of one node, keyed by peer name."""

    def __init__(
        self,
        name: str,
        codec: Codec,
        transport: Transport,
        resolve: Callable[[str], Address],
        config: NodeConfig,
        secret: bytes | None = None,
    ) -> None:
        self.name = name
        self.counts = OutCounts()
        self.watch = DeadlineWatch(self.counts.count_deadline)
        self.retired = ConnectionStatistics("retired", 0, 0, 0, 0)
        self._codec = codec
        self._transport = transport
        self._resolve = resolve
        self._config = config
        self._secret = secret
        self._sessions: dict[str, ClientSession] = {}
        self._dial_locks: dict[str, anyio.Lock] = {}

    def sessions(self) -> list[ClientSession]:
        return list(self._sessions.values())

    def address_of(self, peer: str) -> Address:
        try:
            return self._resolve(peer)
        except KeyError as exc:
            raise UnknownPeer(f"peer {peer!r} is not known to node {self.name!r}") from exc

    def live(self, peer: str) -> ClientSession | None:
        """The session to `peer` if one is open now (the common case, without an await)."""
        session = self._sessions.get(peer)
        return session if session is not None and session.alive else None

    async def session(
        self, peer: str, deadline: float, group: anyio.abc.TaskGroup
    ) -> ClientSession:
        """The live session to `peer`, dialling it (before `deadline`) if there is none."""
        session = self._sessions.get(peer)
        if session is not None and session.alive:
            return session
        async with self._dial_locks.setdefault(peer, anyio.Lock()):
            session = self._sessions.get(peer)
            if session is None or not session.alive:
                connect_by = min(deadline, anyio.current_time() + self._config.connect_timeout)
                with deadline_scope(connect_by, f"connect to {peer}", self.counts.count_deadline):
                    session = await self._dial(peer)
                self._sessions[peer] = session
                group.start_soon(self._run, session)
        return session

    async def _dial(self, peer: str) -> ClientSession:
        address = self.address_of(peer)
        try:
            stream = await self._transport.connect(address)
        except OSError as exc:
            raise PeerGone(f"cannot connect to {peer!r} at {address}: {exc}") from exc
        config = self._config
        conn = Connection(
            stream, self._codec, peer=peer,
            receive_size=config.receive_size, send_buffer=config.send_buffer,
            on_deadline=self.counts.count_deadline,
        )
        try:
            await client_handshake(conn, self.name, self._secret)
            if conn.peer != peer:
                raise HandshakeError(f"dialled {peer!r} at {address} but {conn.peer!r} answered")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await conn.aclose()
            raise
        return ClientSession(conn, config.stream_buffer, self.watch)

    async def _run(self, session: ClientSession) -> None:
        try:
            await session.run()
        finally:
            if self._sessions.get(session.peer) is session:
                del self._sessions[session.peer]
            self.counts.stray += session.stray_frames
            self.retired = add_traffic(self.retired, session.conn.statistics())
