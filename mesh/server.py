"""The serving side: typed handlers, and the sessions that feed them requests.

A `ServerSession` reads one accepted connection. New requests (`Call`, `Cast`, `Open`, `Push`)
go into the node's bounded mailbox, each with its own cancel scope (deadline from the caller's
relative timeout); stream items go straight to that upload's own mailbox, so a handler that
waits for items never waits behind the node mailbox. The node's worker tasks take requests
from the mailbox and run them through `Handlers.run`: a handler that raises is logged with
its context (peer, message type, correlation id) and the waiting peer gets a `Fail`; the
service keeps serving everyone else. When a connection ends, its requests are cancelled and
its uploads fail with `PeerGone`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from mesh.connection import Connection
from mesh.errors import ConfigError, FrameDecodeError, FrameTooLarge, PeerGone, StreamAborted
from mesh.mailbox import Mailbox
from mesh.wire import Abort, Call, Cast, End, Envelope, Fail, Item, Open, Push, Reply

if TYPE_CHECKING:
    from mesh.node import Node

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class Context:
    """What a handler knows about the request it serves."""

    node: Node
    peer: str
    id: int
    deadline: float


UnaryHandler = Callable[[M, Context], Awaitable[msgspec.Struct | None]]
StreamHandler = Callable[[M, Context], AsyncGenerator[msgspec.Struct, None]]
UploadHandler = Callable[[M, Mailbox[msgspec.Struct], Context], Awaitable[msgspec.Struct | None]]


@dataclass(slots=True)
class Request:
    """One inbound request, from its arrival until its handler is done."""

    session: ServerSession
    envelope: Call[Any] | Cast[Any] | Open[Any] | Push[Any]
    # None for casts: nobody waits for them, so nothing needs to stop them early.
    scope: anyio.CancelScope | None
    uploads: Mailbox[msgspec.Struct] | None = None
    aborted: bool = False

    @property
    def id(self) -> int:
        return 0 if isinstance(self.envelope, Cast) else self.envelope.id

    @property
    def body(self) -> msgspec.Struct:
        body: msgspec.Struct = self.envelope.body
        return body


@dataclass
class HandlerCounts:
    """Mutable counters behind NodeStatistics (owned by one node)."""

    requests: int = 0
    handler_errors: int = 0
    deadlines: int = 0
    connection_errors: int = 0
    stray_frames: int = 0


@dataclass
class Handlers:
    """The node's handler table: one handler per message type, of one of three kinds."""

    messages: tuple[type[msgspec.Struct], ...]
    unary: dict[type[Any], UnaryHandler[Any]] = field(default_factory=dict)
    streams: dict[type[Any], StreamHandler[Any]] = field(default_factory=dict)
    uploads: dict[type[Any], UploadHandler[Any]] = field(default_factory=dict)
    counts: HandlerCounts = field(default_factory=HandlerCounts)

    def add(self, table: dict[type[Any], Any], message: type[Any], handler: object) -> None:
        if message not in self.messages:
            raise ConfigError(f"message type {message.__name__} is not in the node's codec")
        if any(message in t for t in (self.unary, self.streams, self.uploads)):
            raise ConfigError(f"message type {message.__name__} already has a handler")
        table[message] = handler

    async def run(self, request: Request) -> None:
        """Runs one request's handler and answers the peer; never raises for handler bugs."""
        self.counts.requests += 1
        try:
            with request.scope or nullcontext():
                await self._dispatch(request)
        except StreamAborted as exc:
            await _answer(request, Abort(request.id, str(exc)))
        except Exception as exc:
            if isinstance(exc, PeerGone) and request.session.conn.closed:
                log.info("client %s left during request %d", request.session.peer, request.id)
                return
            self.counts.handler_errors += 1
            log.exception(
                "handler for %s from %s (id %d) failed",
                type(request.body).__name__, request.session.peer, request.id,
            )
            await _answer(request, Fail(request.id, type(exc).__name__, str(exc)))
        else:
            scope = request.scope
            if scope is not None and scope.cancelled_caught and not request.aborted:
                self.counts.deadlines += 1
                detail = f"{type(request.body).__name__} handler passed its deadline"
                await _answer(request, Fail(request.id, "DeadlineExceeded", detail))
        finally:
            request.session.finish(request)

    async def _dispatch(self, request: Request) -> None:
        envelope, kind = request.envelope, type(request.body)
        session = request.session
        deadline = math.inf if request.scope is None else request.scope.deadline
        ctx = Context(session.node, session.peer, request.id, deadline)
        if isinstance(envelope, Call | Cast) and kind in self.unary:
            result = await self.unary[kind](request.body, ctx)
            if isinstance(envelope, Call):
                await _answer(request, Reply(request.id, result))
        elif isinstance(envelope, Open) and kind in self.streams:
            async with aclosing(self.streams[kind](request.body, ctx)) as items:
                async for item in items:
                    await request.session.conn.send(Item(request.id, item), urgent=False)
            await _answer(request, End(request.id))
        elif isinstance(envelope, Push) and kind in self.uploads:
            assert request.uploads is not None
            result = await self.uploads[kind](request.body, request.uploads, ctx)
            await _answer(request, Reply(request.id, result))
        else:
            want = type(envelope).__name__
            raise LookupError(f"no {want} handler for message type {kind.__name__}")


async def _answer(request: Request, envelope: Envelope) -> None:
    """Sends an answer unless the peer has gone or abandoned the request."""
    if isinstance(request.envelope, Cast) or request.aborted or request.session.conn.closed:
        if isinstance(envelope, Fail):
            log.warning("unanswered failure for %s: %s", request.session.peer, envelope)
        return
    try:
        await request.session.conn.send(envelope)
    except PeerGone as exc:
        log.info("answer to %s (id %d) lost: %s", request.session.peer, request.id, exc)


class ServerSession:
    """One accepted connection: routes its frames into the node's mailbox and uploads."""

    def __init__(
        self, node: Node, conn: Connection, mailbox: Mailbox[Request], counts: HandlerCounts
    ) -> None:
        self.node = node
        self.conn = conn
        self._mailbox = mailbox
        self._counts = counts
        self._active: dict[int, Request] = {}

    @property
    def peer(self) -> str:
        return self.conn.peer

    async def run(self, upload_buffer: int) -> None:
        """Reads until the peer leaves or sends garbage; a bad frame ends this session only."""
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.conn.run_writer)
                await self._read(upload_buffer)
                group.cancel_scope.cancel()
        finally:
            self._fail_all(PeerGone(f"client {self.peer} disconnected"))
            with anyio.CancelScope(shield=True):
                await self.conn.aclose()

    async def _read(self, upload_buffer: int) -> None:
        try:
            while True:
                await self._route(await self.conn.receive(), upload_buffer)
        except PeerGone as exc:
            log.info("client %s left: %s", self.peer, exc)
        except (FrameDecodeError, FrameTooLarge) as exc:
            self._counts.connection_errors += 1
            log.warning("dropping client %s after a bad frame: %s", self.peer, exc)

    def check_integrity(self) -> None:
        for id, request in self._active.items():
            assert request.id == id, "active request filed under another id"
            assert not isinstance(request.envelope, Cast), "casts are never active"

    def finish(self, request: Request) -> None:
        if self._active.get(request.id) is request:
            del self._active[request.id]
        if request.uploads is not None:
            request.uploads.close()

    async def _route(self, envelope: Envelope, upload_buffer: int) -> None:
        if isinstance(envelope, Call | Cast | Open | Push):
            await self._admit(envelope, upload_buffer)
        elif isinstance(envelope, Item | End | Abort):
            await self._deliver(envelope)
        else:
            raise FrameDecodeError(f"{self.peer} sent {type(envelope).__name__} to a server")

    async def _admit(
        self, envelope: Call[Any] | Cast[Any] | Open[Any] | Push[Any], buffer: int
    ) -> None:
        if isinstance(envelope, Cast):
            await self._mailbox.put(Request(self, envelope, None))
            return
        if envelope.id in self._active:
            raise FrameDecodeError(f"{self.peer} reused active request id {envelope.id}")
        timeout = envelope.timeout
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        request = Request(self, envelope, anyio.CancelScope(deadline=deadline))
        if isinstance(envelope, Push):
            request.uploads = Mailbox(buffer)
        self._active[envelope.id] = request
        await self._mailbox.put(request)

    async def _deliver(self, envelope: Item[Any] | End | Abort) -> None:
        request = self._active.get(envelope.id)
        if request is None:
            # The handler has already finished (it may stop reading early): drop and count.
            self._counts.stray_frames += 1
            return
        if isinstance(envelope, Abort):
            request.aborted = True
            # An upload's handler learns of the abort from its items; others just stop.
            if request.uploads is not None:
                request.uploads.fail(StreamAborted(f"{self.peer}: {envelope.reason}"))
            elif request.scope is not None:
                request.scope.cancel()
        elif request.uploads is None:
            raise FrameDecodeError(f"{self.peer} sent {type(envelope).__name__} to a non-upload")
        elif isinstance(envelope, End):
            request.uploads.end()
        elif not await request.uploads.put(envelope.body):
            self._counts.stray_frames += 1

    def _fail_all(self, reason: PeerGone) -> None:
        for request in self._active.values():
            request.aborted = True
            if request.scope is not None:
                request.scope.cancel()
            if request.uploads is not None:
                request.uploads.fail(reason)
