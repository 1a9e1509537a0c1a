"""A framed, handshaken connection to one peer: sends and receives envelopes.

Wraps any anyio `ByteStream` (TCP or in-memory) with the codec. `send` encodes one frame and
hands it to the connection's `Outbox`, which keeps frames in order whether they are written at
once (urgent) or batched by the writer task (`run_writer`). `receive` feeds an incremental
parser with large reads (docs/engineering-notes.md G4: `receive_exactly` caps small-frame
rates). The handshake is one `Hello` each way carrying the protocol version and the peer's
name, plus, when the mesh has a shared secret, a `Proof` from the client (mesh.membership).
Stream
errors are translated to `PeerGone` here and in the outbox, once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio
import anyio.abc
import msgspec

from mesh.errors import HandshakeError, MeshError, PeerGone
from mesh.membership import NONCE_SIZE, new_nonce, proof, verify
from mesh.outbox import STREAM_ERRORS, Outbox
from mesh.parser import FrameParser
from mesh.tcp import AsyncioSocketStream, TrioSocketStream
from mesh.transport import MemoryByteStream
from mesh.wire import PROTOCOL_VERSION, Codec, Envelope, Fail, Hello, Proof

RECEIVE_SIZE = 1024 * 1024
SEND_BUFFER = 4 * 1024 * 1024


class ConnectionStatistics(msgspec.Struct, frozen=True):
    """Traffic on one connection since it opened, and bytes waiting to be written."""

    peer: str
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    queued_bytes: int = 0
    # Memory the receive side keeps for a frame not yet complete (FrameParser.capacity).
    receive_buffer: int = 0


def add_traffic(total: ConnectionStatistics, more: ConnectionStatistics) -> ConnectionStatistics:
    """`total` plus the traffic of `more` (to keep counting connections that have closed)."""
    return ConnectionStatistics(
        total.peer,
        total.frames_in + more.frames_in,
        total.frames_out + more.frames_out,
        total.bytes_in + more.bytes_in,
        total.bytes_out + more.bytes_out,
    )


class Connection:
    """Envelopes over a byte stream; `peer` is the name the other side gave in its Hello."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        codec: Codec,
        *,
        peer: str = "?",
        receive_size: int = RECEIVE_SIZE,
        send_buffer: int = SEND_BUFFER,
        on_deadline: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._codec = codec
        self._parser = FrameParser(codec)
        self._ready: deque[Envelope] = deque()
        self._receive_size = receive_size
        # on_deadline: told when a send gives up waiting for room (counted as a deadline).
        self._outbox = Outbox(stream, peer, send_buffer, on_deadline)
        self._closed = False
        self._frames_in = self._frames_out = self._bytes_in = self._bytes_out = 0
        self._route: Callable[[Envelope], None] | None = None
        self._route_some: Callable[[Envelope], bool] | None = None
        self._receive_into: Callable[[memoryview], Awaitable[int]] | None = (
            stream.receive_into if isinstance(stream, TrioSocketStream) else None)
        if isinstance(stream, AsyncioSocketStream):
            stream.fill_into(self._fill_into, self._filled)
        # A frame error met while delivering directly, raised by the next `receive`.
        self._failure: MeshError | None = None

    @property
    def peer(self) -> str:
        return self._outbox.peer

    @peer.setter
    def peer(self, name: str) -> None:
        self._outbox.peer = name

    @property
    def closed(self) -> bool:
        return self._closed or self._outbox.broken is not None

    async def send(
        self, envelope: Envelope, *, urgent: bool = True, deadline: float = math.inf
    ) -> None:
        """Encodes one frame and writes it (urgent) or queues it for the writer task.

        FrameTooLarge fails this send only; PeerGone once the connection is broken;
        DeadlineExceeded if the queue stays full until `deadline`.
        """
        parts = self._codec.encode_parts(envelope)
        self._frames_out += 1
        self._bytes_out += sum(len(part) for part in parts)
        if len(parts) > 1:
            await self._outbox.put(parts, urgent=urgent, deadline=deadline)
        elif not ((urgent or self._outbox.inline_deferred)
                  and self._outbox.put_nowait(parts[0])):
            await self._outbox.put(parts[0], urgent=urgent, deadline=deadline)

    async def run_writer(self) -> None:
        """Writes deferred frames in batches; run it beside the reader for the connection's life."""
        await self._outbox.run()

    def deliver_directly(self, route: Callable[[Envelope], None] | None) -> bool:
        """Lets frames skip the task that calls `receive`, where the stream allows it.

        On asyncio TCP streams each chunk that arrives while nothing waits to be received
        is parsed in the event loop's callback and its frames handed to `route`, which must
        not block; a MeshError it raises comes out of the next `receive`. None turns this
        off. The in-memory pipe does the same in the task that sends the chunk. False where
        the stream cannot (trio TCP): all frames come via `receive`.
        """
        if not isinstance(self._stream, AsyncioSocketStream | MemoryByteStream):
            return False
        self._route = route
        self._stream.deliver_to(None if route is None else self._consume)
        return True

    def deliver_some(self, route: Callable[[Envelope], bool] | None) -> bool:
        """Offers frames to `route` in the sending task, where the stream allows it (the
        in-memory pipe): each frame that arrives while nothing waits for `receive` goes to
        `route`, which takes it (True) without blocking, or leaves it, and every frame after
        it, to `receive` (False). None turns this off. False where the stream cannot."""
        if not isinstance(self._stream, MemoryByteStream):
            return False
        self._route_some = route
        self._stream.deliver_to(None if route is None else self._consume_some)
        return True

    def _consume_some(self, data: bytes | bytearray) -> bool:
        route = self._route_some
        if route is None or self._ready or self._failure is not None:
            return False
        try:
            envelopes = self._parser.feed(data)
        except MeshError as exc:
            # Queue the chunk after all: that wakes the reader, and `receive` raises this.
            self._failure = exc
            return False
        self._bytes_in += len(data)
        for envelope in envelopes:
            if self._ready or not route(envelope):
                self._ready.append(envelope)
            else:
                self._frames_in += 1
        if self._ready:
            assert isinstance(self._stream, MemoryByteStream)
            self._stream.wake_reader()
        return True

    def _fill_into(self) -> memoryview | None:
        """Where an asyncio stream may put the next bytes itself (FrameParser.into)."""
        return None if self._failure is not None else self._parser.into()

    def _filled(self, count: int) -> bool:
        """`count` bytes landed where `_fill_into` said. A completed frame goes to the route
        when direct delivery is on and nothing waits ahead of it, else to `receive`; True if
        the reader must look (a frame for it, or the route's error to raise)."""
        self._bytes_in += count
        try:
            envelopes = self._parser.filled(count)
        except MeshError as exc:
            self._failure = exc
            return True
        route = self._route
        for envelope in envelopes:
            if route is None or self._ready:
                self._ready.append(envelope)
                continue
            try:
                self._frames_in += 1
                route(envelope)
            except MeshError as exc:
                self._failure = exc
                return True
        return bool(self._ready)

    def _consume(self, data: bytes | bytearray) -> bool:
        route = self._route
        if route is None or self._ready or self._failure is not None:
            return False
        try:
            for envelope in self._parser.feed(data):
                self._frames_in += 1
                route(envelope)
        except MeshError as exc:
            # Queue the chunk after all: that wakes the reader, and `receive` raises this.
            self._failure = exc
            return False
        self._bytes_in += len(data)
        return True

    async def receive(self) -> Envelope:
        """The next envelope; PeerGone at end of stream, FrameDecodeError on garbage."""
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            # A bulk frame under way is read straight into its own buffer where the stream
            # can (FrameParser.into): no chunk to copy it from.
            into = self._parser.into() if self._receive_into is not None else None
            try:
                if into is not None:
                    assert self._receive_into is not None
                    count = await self._receive_into(into)
                else:
                    data = await self._stream.receive(self._receive_size)
            except STREAM_ERRORS as exc:
                raise PeerGone(f"connection from {self.peer} ended: {exc!r}") from exc
            if self._failure is not None:
                raise self._failure
            if into is not None:
                self._bytes_in += count
                self._ready.extend(self._parser.filled(count))
            else:
                self._bytes_in += len(data)
                self._ready.extend(self._parser.feed(data))
        self._frames_in += 1
        return self._ready.popleft()

    async def aclose(self) -> None:
        self._closed = True
        await self._stream.aclose()

    def check_integrity(self) -> None:
        self._outbox.check_integrity()
        assert self._frames_in >= 0 and self._bytes_in >= 0

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            peer=self.peer,
            frames_in=self._frames_in,
            frames_out=self._frames_out,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            queued_bytes=self._outbox.queued_bytes,
            receive_buffer=self._parser.capacity,
        )


async def _expect_hello(conn: Connection) -> Hello:
    envelope = await conn.receive()
    if isinstance(envelope, Fail):
        raise HandshakeError(f"peer refused the handshake: {envelope.error}: {envelope.detail}")
    if not isinstance(envelope, Hello):
        raise HandshakeError(f"expected Hello as first frame, got {type(envelope).__name__}")
    return envelope


async def client_handshake(conn: Connection, name: str, secret: bytes | None = None) -> Connection:
    """Says Hello, then waits for the server's; names the connection after the server.

    With a `secret`, the server must prove membership in its Hello, and this side answers
    with its own `Proof` (mesh.membership); HandshakeError if the server's is missing or wrong.
    """
    nonce = new_nonce()
    await conn.send(Hello(PROTOCOL_VERSION, name, nonce))
    hello = await _expect_hello(conn)
    if hello.protocol != PROTOCOL_VERSION:
        raise HandshakeError(f"server {hello.name!r} speaks protocol {hello.protocol}")
    conn.peer = hello.name
    if secret is not None:
        expected = proof(secret, "server", name, hello.name, nonce, hello.nonce)
        if not verify(expected, hello.proof):
            raise HandshakeError(f"server {hello.name!r} did not prove mesh membership")
        await conn.send(Proof(proof(secret, "client", name, hello.name, nonce, hello.nonce)))
    return conn


async def server_handshake(conn: Connection, name: str, secret: bytes | None = None) -> Connection:
    """Waits for the client's Hello; refuses other protocol versions with a Fail frame.

    With a `secret`, the client must answer this side's nonce with a valid `Proof` before
    anything else; otherwise it gets a Fail and HandshakeError is raised.
    """
    hello = await _expect_hello(conn)
    conn.peer = hello.name
    if hello.protocol != PROTOCOL_VERSION:
        detail = f"protocol={hello.protocol}, this server speaks {PROTOCOL_VERSION}"
        await _refuse(conn, detail)
    if secret is None:
        await conn.send(Hello(PROTOCOL_VERSION, name))
        return conn
    if len(hello.nonce) != NONCE_SIZE:
        await _refuse(conn, f"membership needs a {NONCE_SIZE}-byte nonce in the Hello")
    nonce = new_nonce()
    mine = proof(secret, "server", hello.name, name, hello.nonce, nonce)
    await conn.send(Hello(PROTOCOL_VERSION, name, nonce, mine))
    answer = await conn.receive()
    expected = proof(secret, "client", hello.name, name, hello.nonce, nonce)
    if not (isinstance(answer, Proof) and verify(expected, answer.mac)):
        await _refuse(conn, f"no valid membership proof (got {type(answer).__name__})")
    return conn


async def _refuse(conn: Connection, detail: str) -> NoReturn:
    """Tells the client why (a Fail frame), then raises HandshakeError naming it."""
    await conn.send(Fail(0, "HandshakeError", detail))
    raise HandshakeError(f"client {conn.peer!r}: {detail}")
