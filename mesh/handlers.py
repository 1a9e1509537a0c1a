"""Handlers: the node's table of typed handlers, and running one request through it.

A request's handler runs in one of two ways (mesh.server decides which): queued, in a node
worker under the request's own cancel scope (`Handlers.run`), or eagerly, in the connection's
reader task (`Handlers.run_eagerly`), which hands the request a task of its own only if the
handler suspends. Both answer alike: a handler that raises is logged with its context (peer,
message type, correlation id) and the waiting peer gets a `Fail`; the service keeps serving
everyone else.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field
from types import CoroutineType
from typing import Any, Protocol, TypeVar

import msgspec

from mesh.connection import Connection
from mesh.eager import Eager
from mesh.errors import ConfigError, MeshError, PeerGone, RequestFailed, StreamAborted
from mesh.mailbox import Mailbox
from mesh.native import DeadlineScope
from mesh.wire import Abort, Call, Cast, End, Envelope, Fail, Item, Open, Push, Reply

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)


class Context(msgspec.Struct, frozen=True):
    """What a handler knows about the request it serves."""

    peer: str
    id: int
    deadline: float


UnaryHandler = Callable[[M, Context], Awaitable[msgspec.Struct | None]]
StreamHandler = Callable[[M, Context], AsyncGenerator[msgspec.Struct, None]]
UploadHandler = Callable[[M, Mailbox[msgspec.Struct], Context], Awaitable[msgspec.Struct | None]]


class Session(Protocol):
    """What a request needs of the connection it came on (mesh.server.ServerSession)."""

    peer: str
    conn: Connection

    def finish(self, request: Request) -> None: ...


class Request:
    """One inbound request, from its arrival until its handler is done."""

    __slots__ = ("aborted", "body", "deadline", "envelope", "id", "scope", "session", "uploads")

    def __init__(
        self,
        session: Session,
        envelope: Call[Any] | Cast[Any] | Open[Any] | Push[Any],
        deadline: float,
    ) -> None:
        self.session = session
        self.envelope = envelope
        # Absolute, on the loop's clock; inf for casts and calls sent without a timeout.
        self.deadline = deadline
        self.id: int = 0 if isinstance(envelope, Cast) else envelope.id
        self.body: msgspec.Struct = envelope.body
        # What stops the handler early (deadline, abort, the client leaving). None for casts
        # (nobody waits for them) and for a request run eagerly until its handler suspends.
        self.scope: DeadlineScope | None = None
        self.uploads: Mailbox[msgspec.Struct] | None = None
        self.aborted = False

    def context(self) -> Context:
        session = self.session
        return Context(session.peer, self.id, self.deadline)


@dataclass
class HandlerCounts:
    """Mutable counters behind NodeStatistics (owned by one node)."""

    requests: int = 0
    handler_errors: int = 0
    deadlines: int = 0
    connection_errors: int = 0
    stray_frames: int = 0
    eager: int = 0
    handed_off: int = 0


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
        """Runs one queued request under its scope and answers; never raises for handler bugs."""
        self.counts.requests += 1
        try:
            with request.scope or nullcontext():
                await self._dispatch(request)
        except Exception as exc:
            await self._failed(request, exc)
        else:
            scope = request.scope
            if scope is not None and scope.cancelled_caught:
                await self.expired(request)
        finally:
            request.session.finish(request)

    async def run_eagerly(self, request: Request, on_suspend: Callable[[], None]) -> None:
        """Runs a unary request in this task; `on_suspend` if its handler ever suspends.

        Cancellation (the request's deadline, once `on_suspend` has put it under a scope)
        propagates: the caller's scope catches it and calls `expired`.
        """
        self.counts.requests += 1
        self.counts.eager += 1
        try:
            body = request.body
            pending = self.unary[type(body)](body, request.context())
            if type(pending) is CoroutineType:
                result = await Eager(pending, on_suspend)
            else:
                on_suspend()
                result = await pending
            if isinstance(request.envelope, Call):
                await answer(request, Reply(request.id, result))
        except Exception as exc:
            await self._failed(request, exc)
        finally:
            request.session.finish(request)

    async def expired(self, request: Request) -> None:
        """Answers a request whose scope stopped its handler: a deadline, unless aborted."""
        if not request.aborted:
            self.counts.deadlines += 1
            detail = f"{type(request.body).__name__} handler passed its deadline"
            await answer(request, Fail(request.id, "DeadlineExceeded", detail))

    async def _failed(self, request: Request, exc: Exception) -> None:
        if isinstance(exc, StreamAborted):
            await answer(request, Abort(request.id, str(exc)))
            return
        if isinstance(exc, PeerGone) and request.session.conn.closed:
            log.info("client %s left during request %d", request.session.peer, request.id)
            return
        self.counts.handler_errors += 1
        what = (type(request.body).__name__, request.session.peer, request.id)
        if isinstance(exc, RequestFailed | MeshError):
            # Expected (a timeout, a peer gone, a refused request): the caller is told.
            log.warning("handler for %s from %s (id %d) failed: %s: %s", *what,
                        type(exc).__name__, exc)
        else:
            log.error("handler for %s from %s (id %d) failed", *what, exc_info=exc)
        await answer(request, Fail(request.id, type(exc).__name__, str(exc)))

    async def _dispatch(self, request: Request) -> None:
        envelope, kind = request.envelope, type(request.body)
        ctx = request.context()
        if isinstance(envelope, Call | Cast) and kind in self.unary:
            result = await self.unary[kind](request.body, ctx)
            if isinstance(envelope, Call):
                await answer(request, Reply(request.id, result))
        elif isinstance(envelope, Open) and kind in self.streams:
            async with aclosing(self.streams[kind](request.body, ctx)) as items:
                async for item in items:
                    await request.session.conn.send(Item(request.id, item), urgent=False)
            await answer(request, End(request.id))
        elif isinstance(envelope, Push) and kind in self.uploads:
            assert request.uploads is not None
            result = await self.uploads[kind](request.body, request.uploads, ctx)
            await answer(request, Reply(request.id, result))
        else:
            want = type(envelope).__name__
            raise LookupError(f"no {want} handler for message type {kind.__name__}")


async def answer(request: Request, envelope: Envelope) -> None:
    """Sends an answer unless the peer has gone or abandoned the request."""
    if isinstance(request.envelope, Cast) or request.aborted or request.session.conn.closed:
        if isinstance(envelope, Fail):
            log.warning("unanswered failure for %s: %s", request.session.peer, envelope)
        return
    try:
        await request.session.conn.send(envelope)
    except PeerGone as exc:
        log.info("answer to %s (id %d) lost: %s", request.session.peer, request.id, exc)
