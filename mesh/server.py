"""The serving side: the sessions that read accepted connections and feed their handlers.

A `ServerSession` reads one accepted connection. A new request reaches its handler by one of
two paths, and either way at most `max_concurrency` handlers of the node run at once
(mesh.slots):

* eager: a unary `Call` or `Cast` is run by the reader task itself when nothing waits in the
  node's mailbox and a handler slot is free. Most control handlers finish without
  suspending, and then the reply is written by the task that read the request: no hand-off,
  no task, no cancel scope (on the 2-vCPU host those were most of a small round trip's CPU;
  benchmarks/bench_wire.py). If the handler does suspend, the reader task becomes the
  request's own task (mesh.eager tells us at the first suspension): its cancel scope,
  entered once per reader, takes the request's deadline and answers aborts, and a new
  reader task takes over the connection. So a slow handler never holds back the requests
  behind it, as before.
* queued: streams, uploads, and unary requests that find the mailbox non-empty or every slot
  busy go into the node's bounded mailbox, each with its own cancel scope (deadline from the
  caller's relative timeout); the node's workers run them in order. A full mailbox makes the
  reader wait, which pushes back on the peer. A message type registered with a pool of its
  own (mesh.pools) has its own mailbox, slots and workers; all of the above holds per pool.

Stream items go straight to their upload's own mailbox, so a handler waiting for items never
waits behind the node mailbox. On the in-memory pipe they go there in the sending task while
no reader holds a frame and the upload has room (`Connection.deliver_some`): a KV stream's
pieces then wake the handler alone, not a reader first. When a connection ends, its calls
and streams are cancelled and its uploads fail with `PeerGone`; casts, which nobody waits
for, run to their end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, cast

import anyio

from mesh.connection import Connection
from mesh.errors import FrameDecodeError, FrameTooLarge, MeshError, PeerGone, StreamAborted
from mesh.handlers import (
    Context,
    HandlerCounts,
    Handlers,
    Request,
    StreamHandler,
    UnaryHandler,
    UploadHandler,
)
from mesh.mailbox import Mailbox
from mesh.native import DeadlineScope, deadline_scope
from mesh.pools import Pool
from mesh.wire import Abort, Call, Cast, End, Envelope, Item, Open, Push

__all__ = [
    "Context",
    "HandlerCounts",
    "Handlers",
    "Request",
    "ServerSession",
    "StreamHandler",
    "UnaryHandler",
    "UploadHandler",
]

log = logging.getLogger(__name__)

# Starts a task (a task group's `start_soon`).
Spawn = Callable[[Callable[[], Coroutine[Any, Any, None]]], object]
# The pool a message type's requests queue and run in (Node.pool_for).
PoolFor = Callable[[type[Any]], Pool[Request]]


class _Reader:
    """One reader task's cancel scope, and the request it turned into the task of, if any."""

    __slots__ = ("request", "scope")

    def __init__(self, scope: DeadlineScope) -> None:
        self.scope = scope
        self.request: Request | None = None


class ServerSession:
    """One accepted connection: runs or queues its requests, and feeds its uploads."""

    def __init__(
        self,
        clock: Callable[[], float],
        conn: Connection,
        pools: PoolFor,
        handlers: Handlers,
        spawn: Spawn,
    ) -> None:
        # The node's clock, for the deadlines of calls that arrive here.
        self._now = clock
        self.conn = conn
        self.peer = conn.peer
        self._pools = pools
        self._handlers = handlers
        self._counts = handlers.counts
        # Starts reader tasks in the node's group: a reader may turn into a cast's handler,
        # which should run to its end even after this session is over.
        self._spawn = spawn
        self._upload_buffer = 1
        self._ended = anyio.Event()
        self._active: dict[int, Request] = {}
        # A reader task holds a frame it has not finished routing: frames after it wait
        # for it (`_deliver_now` leaves them to `receive`).
        self._routing = False
        conn.deliver_some(self._deliver_now)

    async def run(self, upload_buffer: int) -> None:
        """Serves until the peer leaves or sends garbage; a bad frame ends this session only."""
        self._upload_buffer = upload_buffer
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.conn.run_writer)
                self._spawn(self._read)
                await self._ended.wait()
                group.cancel_scope.cancel()
        finally:
            self._ended.set()
            self.conn.deliver_some(None)
            self._fail_all(PeerGone(f"client {self.peer} disconnected"))
            with anyio.CancelScope(shield=True):
                await self.conn.aclose()

    def check_integrity(self) -> None:
        for id, request in self._active.items():
            assert request.id == id, "active request filed under another id"
            assert not isinstance(request.envelope, Cast), "casts are never active"

    def finish(self, request: Request) -> None:
        if self._active.get(request.id) is request:
            del self._active[request.id]
        if request.uploads is not None:
            request.uploads.close()

    async def _read(self) -> None:
        """A reader task: routes frames until the connection ends or it becomes a handler's."""
        # The loop's own scope (mesh.native): one per reader, so one per handed-off request.
        scope = deadline_scope()
        with scope:
            reader = _Reader(scope)
            await self._route_all(reader)
        if reader.request is not None and scope.cancelled_caught:
            await self._handlers.expired(reader.request)

    async def _route_all(self, reader: _Reader) -> None:
        try:
            while True:
                self._routing = False
                envelope = await self.conn.receive()
                self._routing = True
                if isinstance(envelope, Call | Cast) and self._eager(envelope):
                    if await self._run_eagerly(envelope, reader):
                        return
                else:
                    await self._route(envelope)
        except PeerGone as exc:
            # Debug only: clients come and go (every service's at each stop of the mesh).
            log.debug("client %s left: %s", self.peer, exc)
        except (FrameDecodeError, FrameTooLarge) as exc:
            self._counts.connection_errors += 1
            log.warning("dropping client %s after a bad frame: %s", self.peer, exc)
        self._ended.set()

    def _eager(self, envelope: Call[Any] | Cast[Any]) -> bool:
        """Whether to run this request here: a unary handler, nothing queued in its pool, a
        free slot there (taken)."""
        kind = type(envelope.body)
        if kind not in self._handlers.unary:
            return False
        pool = self._pools(kind)
        return pool.mailbox.empty and pool.slots.try_take()

    async def _run_eagerly(self, envelope: Call[Any] | Cast[Any], reader: _Reader) -> bool:
        """Runs the handler in this task; True if it suspended (then this task is its own)."""
        try:
            if isinstance(envelope, Call):
                self._check_new_id(envelope.id)
            request = Request(self, envelope, self._deadline(envelope))
            await self._handlers.run_eagerly(request, partial(self._hand_off, request, reader))
        finally:
            self._pools(type(envelope.body)).slots.give()
        return reader.request is not None

    def _hand_off(self, request: Request, reader: _Reader) -> None:
        """The handler suspended: this task becomes its own; a new one reads the connection."""
        self._routing = False
        self._counts.handed_off += 1
        reader.request = request
        if isinstance(request.envelope, Call):
            reader.scope.deadline = request.deadline
            request.scope = reader.scope
            self._active[request.envelope.id] = request
        self._spawn(self._read)

    async def _route(self, envelope: Envelope) -> None:
        if isinstance(envelope, Call | Cast | Open | Push):
            await self._admit(envelope)
        elif isinstance(envelope, Item | End | Abort):
            await self._deliver(envelope)
        else:
            raise FrameDecodeError(f"{self.peer} sent {type(envelope).__name__} to a server")

    async def _admit(self, envelope: Call[Any] | Cast[Any] | Open[Any] | Push[Any]) -> None:
        pool = self._pools(type(envelope.body))
        if isinstance(envelope, Cast):
            await pool.put(Request(self, envelope, math.inf))
            return
        self._check_new_id(envelope.id)
        request = self._stream_request(envelope)
        self._active[envelope.id] = request
        await pool.put(request)

    def _stream_request(self, envelope: Call[Any] | Open[Any] | Push[Any]) -> Request:
        """A queued request, under a cancel scope of its own (its deadline, aborts)."""
        request = Request(self, envelope, self._deadline(envelope))
        request.scope = deadline_scope(request.deadline)
        if isinstance(envelope, Push):
            request.uploads = Mailbox(self._upload_buffer)
        return request

    def _open_now(self, envelope: Open[Any] | Push[Any]) -> bool:
        """A stream opened in the sender's task (`_deliver_now`) when its pool's mailbox has
        room now; a reused id, or no room, is left to the reader (which raises or waits)."""
        if envelope.id in self._active:
            return False
        request = self._stream_request(envelope)
        if not self._pools(type(envelope.body)).put_nowait(request):
            return False
        self._active[envelope.id] = request
        return True

    def _check_new_id(self, id: int) -> None:
        if id in self._active:
            raise FrameDecodeError(f"{self.peer} reused active request id {id}")

    def _deadline(self, envelope: Call[Any] | Cast[Any] | Open[Any] | Push[Any]) -> float:
        timeout = None if isinstance(envelope, Cast) else envelope.timeout
        return math.inf if timeout is None else self._now() + timeout

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

    def _deliver_now(self, envelope: Envelope) -> bool:
        """An upload's item or end, or a new stream, handed over in the sender's task
        (Connection.deliver_some) when no reader holds a frame and its upload or pool has
        room: the reader is not woken for it. Everything else (False) goes to a reader,
        which routes it as before (calls and casts too: a reader runs them eagerly)."""
        kind = type(envelope)
        if self._routing:
            return False
        if kind is Open or kind is Push:
            return self._open_now(cast("Open[Any] | Push[Any]", envelope))
        if kind is not Item and kind is not End:
            return False
        request = self._active.get(cast("Item[Any] | End", envelope).id)
        uploads = None if request is None else request.uploads
        if uploads is None or not uploads.open:
            return False
        if kind is End:
            uploads.end()
            return True
        return uploads.put_nowait(cast("Item[Any]", envelope).body)

    def _fail_all(self, reason: MeshError) -> None:
        for request in self._active.values():
            request.aborted = True
            if request.scope is not None:
                request.scope.cancel()
            if request.uploads is not None:
                request.uploads.fail(reason)
