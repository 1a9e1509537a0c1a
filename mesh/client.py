"""The calling side of a connection a node dialled: calls, casts and streams to one peer.

A `ClientSession` owns one handshaken connection and a table of waiters keyed by correlation
id. A call or stream its caller abandons (cancelled, or a stream left early) sends the server
an `Abort`, which cancels the request's handler there. Its reader task (`run`) routes each
`Reply`, `Fail`, `Item`, `End` and `Abort` to the waiter with that id; when the connection
ends, every waiter fails with `PeerGone`, so no caller waits past the loss of its peer. Each
waiter is registered with the node's `DeadlineWatch`, which fails it with `DeadlineExceeded`
at its deadline: no cancel scope per call or per stream item.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

import anyio
import msgspec

from mesh.connection import Connection
from mesh.deadlines import DeadlineWatch, relative_timeout
from mesh.errors import (
    DeadlineExceeded,
    FrameDecodeError,
    MeshError,
    PeerGone,
    RemoteError,
    StreamAborted,
)
from mesh.mailbox import Mailbox
from mesh.native import new_event
from mesh.wire import Abort, Call, Cast, End, Envelope, Fail, Item, Open, Push, Reply

log = logging.getLogger(__name__)

# How long a shielded Abort may wait for room on the connection before we give up on it.
ABANDON_TIMEOUT = 1.0
# What a server may send to a client (a set: cheaper to test than a union isinstance).
ANSWERS = frozenset({Reply, Fail, Item, End, Abort})
Answer = Reply[Any] | Fail | Item[Any] | End | Abort


def unwrap(envelope: Envelope, peer: str) -> msgspec.Struct | None:
    """The body of a Reply; a Fail or Abort becomes the matching exception."""
    if isinstance(envelope, Reply):
        body: msgspec.Struct | None = envelope.body
        return body
    if isinstance(envelope, Fail):
        if envelope.error == "DeadlineExceeded":
            raise DeadlineExceeded(f"{peer}: {envelope.detail}")
        raise RemoteError(peer, envelope.error, envelope.detail)
    if isinstance(envelope, Abort):
        raise StreamAborted(f"{peer}: {envelope.reason}")
    raise FrameDecodeError(f"{peer} answered with an unexpected {type(envelope).__name__}")


class PendingCall:
    """The answer slot of one call: filled once, by the reader or with a failure.

    A Mailbox of one would do, at twice the cost on the request path: this is one native
    Event and two fields.
    """

    __slots__ = ("_answer", "_event", "_failure")

    def __init__(self) -> None:
        self._answer: Envelope | None = None
        self._failure: MeshError | None = None
        self._event = new_event()

    @property
    def open(self) -> bool:
        """Neither answered nor failed: the caller may still be waiting."""
        return self._answer is None and self._failure is None

    def put(self, envelope: Envelope) -> bool:
        """Delivers the answer; False (dropped) once the slot is answered or failed."""
        if not self.open:
            return False
        self._answer = envelope
        self._event.set()
        return True

    def fail(self, error: MeshError) -> None:
        """Fails the call, unless it has already been answered."""
        if self.open:
            self._failure = error
            self._event.set()

    async def get(self) -> Envelope:
        """The answer, once there is one; the failure if that came first."""
        if self.open:
            await self._event.wait()
        if self._answer is not None:
            return self._answer
        assert self._failure is not None
        raise self._failure


class StreamReader:
    """The items of a download stream: `async for item in reader` until the server's End, or
    `await reader.take_each(take)`."""

    def __init__(self, peer: str, inbox: Mailbox[Envelope]) -> None:
        self.peer = peer
        self.finished = False
        self._inbox = inbox
        # take_each: the item `take` declined in the task that put it, queued for the reader
        # to pop without taking it again; and what `take` raised there.
        self._declined = False
        self._raised: BaseException | None = None

    async def take_each(self, take: Callable[[msgspec.Struct], bool]) -> bool:
        """Hands each item to `take`, which must not block, until it returns False (then True,
        the rest of the stream left unread) or the server's End (then False); raises as
        iterating does, and what `take` raised. An item that arrives while this waits is
        handed over in the task that delivers it (Mailbox.consume_directly): the reader wakes
        once, at the stop or the end, not once per item. `async for` is the reference."""
        if self.finished:
            return False
        self._inbox.consume_directly(partial(self._offer, take))
        try:
            while True:
                envelope = await self._inbox.get()
                if self._declined:
                    self._declined = False
                    raised, self._raised = self._raised, None
                    if raised is not None:
                        raise raised
                    return True
                if isinstance(envelope, Item):
                    if not take(envelope.body):
                        return True
                    continue
                self.finished = True
                if isinstance(envelope, End):
                    return False
                unwrap(envelope, self.peer)
                raise FrameDecodeError(f"{self.peer} sent a Reply inside a download stream")
        finally:
            self._inbox.consume_directly(None)

    def _offer(self, take: Callable[[msgspec.Struct], bool], envelope: Envelope) -> bool:
        """`take_each`'s consumer: an item taken (True), or left queued for the reader: not an
        item, or the one `take` declined or raised on (`_declined`)."""
        if self._declined or not isinstance(envelope, Item):
            return False
        try:
            if take(envelope.body):
                return True
        except Exception as exc:
            # Raised in the task that delivered the item, which must not fail for the reader:
            # the reader raises it.
            self._raised = exc
        self._declined = True
        return False

    def __aiter__(self) -> StreamReader:
        return self

    async def __anext__(self) -> msgspec.Struct:
        if self.finished:
            raise StopAsyncIteration
        envelope = await self._inbox.get()
        if isinstance(envelope, Item):
            item: msgspec.Struct = envelope.body
            return item
        self.finished = True
        if isinstance(envelope, End):
            raise StopAsyncIteration
        unwrap(envelope, self.peer)
        raise FrameDecodeError(f"{self.peer} sent a Reply inside a download stream")


class StreamSink:
    """The sending end of an upload stream; `result` holds the server's reply after End."""

    def __init__(
        self, session: ClientSession, id: int, inbox: Mailbox[Envelope], deadline: float
    ) -> None:
        self.result: msgspec.Struct | None = None
        self.sent = 0
        self._session = session
        self._id = id
        self._inbox = inbox
        self._deadline = deadline
        self._early: Envelope | None = None

    async def send(self, item: msgspec.Struct) -> None:
        """Sends one item; raises at once if the server has already failed the stream."""
        self._check_early_answer()
        await self._session.conn.send(Item(self._id, item), urgent=False, deadline=self._deadline)
        self.sent += 1

    def _check_early_answer(self) -> None:
        if self._early is None:
            self._early = self._inbox.get_nowait()
        if isinstance(self._early, Fail | Abort):
            unwrap(self._early, self._session.peer)
        if self._early is None and self._inbox.failure is not None:
            raise self._inbox.failure

    @property
    def answered(self) -> bool:
        """The server has answered (its reply, or a failure): nothing is left to stop."""
        return self._early is not None or self.result is not None

    async def finish(self) -> None:
        """Sends End, then waits for the server's reply."""
        self._check_early_answer()
        await self._session.conn.send(End(self._id), deadline=self._deadline)
        answer = self._early or await self._inbox.get()
        self.result = unwrap(answer, self._session.peer)


class ClientSession:
    """One dialled connection: its waiters and its reader task."""

    def __init__(self, conn: Connection, stream_buffer: int, watch: DeadlineWatch) -> None:
        self.conn = conn
        self.alive = True
        self.stray_frames = 0
        self._stream_buffer = stream_buffer
        self._watch = watch
        self._waiters: dict[int, Mailbox[Envelope] | PendingCall] = {}
        self._ids = itertools.count(1)
        # Open streams. While there are none, every answer can be routed without waiting, so
        # (on asyncio TCP) straight from the event loop's callback: one task switch fewer
        # per call. A stream's items may have to wait for room, so they go through `run`.
        self._streams = 0
        # The reader task holds a frame it has not finished routing: frames after it wait.
        self._routing = False
        # On the in-memory pipe the sending task offers each frame (`_offer`): answers and
        # stream items that find their waiter with room go there without waking `run`, the
        # rest (and everything behind them) to `run`. Elsewhere, direct delivery while no
        # stream is open.
        self._offered = conn.deliver_some(self._offer)
        if not self._offered:
            conn.deliver_directly(self._deliver)

    @property
    def peer(self) -> str:
        return self.conn.peer

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def run(self) -> None:
        """Routes answers to waiters until the connection ends, then fails those left."""
        reason: MeshError = PeerGone(f"connection to {self.peer} closed")
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.conn.run_writer)
                reason = await self._read()
                group.cancel_scope.cancel()
        finally:
            self.alive = False
            if self._offered:
                self.conn.deliver_some(None)
            else:
                self.conn.deliver_directly(None)
            for waiter in self._waiters.values():
                waiter.fail(reason)
            with anyio.CancelScope(shield=True):
                await self.conn.aclose()

    async def _read(self) -> PeerGone:
        try:
            while True:
                self._routing = False
                envelope = await self.conn.receive()
                self._routing = True
                await self._route(envelope)
        except MeshError as exc:
            # Debug only: a node may hold several connections to one peer (KV lanes), each
            # ending at once, and the services log what a lost peer means to them.
            log.debug("connection to %s ended: %s", self.peer, exc)
            return exc if isinstance(exc, PeerGone) else PeerGone(f"{self.peer}: {exc}")

    def _waiter_for(self, envelope: Envelope) -> Mailbox[Envelope] | PendingCall | None:
        if type(envelope) not in ANSWERS:
            raise FrameDecodeError(f"{self.peer} sent {type(envelope).__name__} to a client")
        return self._waiters.get(cast(Answer, envelope).id)

    async def _route(self, envelope: Envelope) -> None:
        waiter = self._waiter_for(envelope)
        if isinstance(waiter, Mailbox):
            # A stream: waits while its buffer is full.
            if not await waiter.put(envelope):
                self.stray_frames += 1
        # A caller that gave up (deadline, early exit) no longer listens: count and drop.
        elif waiter is None or not waiter.put(envelope):
            self.stray_frames += 1

    def _deliver(self, envelope: Envelope) -> None:
        """`_route` for when no stream is open (Connection.deliver_directly)."""
        waiter = self._waiter_for(envelope)
        assert not isinstance(waiter, Mailbox), "direct delivery while a stream is open"
        if waiter is None or not waiter.put(envelope):
            self.stray_frames += 1

    def _offer(self, envelope: Envelope) -> bool:
        """`_route` in the sending task (Connection.deliver_some), for a frame whose waiter
        takes it now; False leaves it, and every frame after it, to `run` (which routes it as
        before, raising for a frame a server may not send or counting a stray)."""
        if self._routing or type(envelope) not in ANSWERS:
            return False
        waiter = self._waiters.get(cast(Answer, envelope).id)
        if waiter is None:
            return False
        if isinstance(waiter, Mailbox):
            return waiter.put_nowait(envelope)
        if not waiter.put(envelope):
            self.stray_frames += 1
        return True

    def _open(self, capacity: int, deadline: float, what: str) -> tuple[int, Mailbox[Envelope]]:
        id = next(self._ids)
        waiter: Mailbox[Envelope] = Mailbox(capacity)
        if not self.alive:
            waiter.fail(PeerGone(f"connection to {self.peer} closed"))
        self._streams += 1
        if self._streams == 1 and not self._offered:
            self.conn.deliver_directly(None)
        self._waiters[id] = waiter
        self._watch.watch(deadline, waiter, what)
        return id, waiter

    def _close(self, id: int) -> None:
        waiter = self._waiters.pop(id)
        if isinstance(waiter, Mailbox):
            waiter.close()
            self._streams -= 1
            if not self._streams and self.alive and not self._offered:
                self.conn.deliver_directly(self._deliver)

    async def _abandon(self, id: int, reason: str) -> None:
        """Tells the server to stop request `id`, even while we are being cancelled."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(ABANDON_TIMEOUT):
            try:
                await self.conn.send(Abort(id, reason))
            except PeerGone:
                # The server is gone, so the request died with it: nothing left to stop.
                log.debug("abort of %d not sent: %s is gone", id, self.peer)

    async def call(
        self, body: msgspec.Struct, deadline: float, timeout: float | None, what: str
    ) -> Envelope:
        """Sends a Call and returns its Reply or Fail; DeadlineExceeded at `deadline`.

        `timeout` is `deadline` as seconds from now, as the callee is told it (None: none).
        """
        id = next(self._ids)
        waiter = PendingCall()
        if not self.alive:
            waiter.fail(PeerGone(f"connection to {self.peer} closed"))
        self._waiters[id] = waiter
        self._watch.watch(deadline, waiter, what)
        try:
            await self.conn.send(Call(id, body, timeout), deadline=deadline)
            return await waiter.get()
        except anyio.get_cancelled_exc_class():
            # The caller gave up (not the deadline: the callee keeps that one itself): tell
            # the callee, so that its handler stops instead of working for nobody.
            if waiter.open and self.alive:
                await self._abandon(id, "the caller cancelled the call")
            raise
        finally:
            del self._waiters[id]

    async def cast(self, body: msgspec.Struct, deadline: float) -> None:
        """Queues a Cast; waits (until `deadline`) only while the send queue is full."""
        await self.conn.send(Cast(body), urgent=False, deadline=deadline)

    @asynccontextmanager
    async def open_stream(
        self, body: msgspec.Struct, deadline: float
    ) -> AsyncIterator[StreamReader]:
        id, waiter = self._open(self._stream_buffer, deadline, f"stream from {self.peer}")
        reader = StreamReader(self.peer, waiter)
        try:
            await self.conn.send(Open(id, body, relative_timeout(deadline)), deadline=deadline)
            yield reader
        finally:
            if not reader.finished and self.alive:
                await self._abandon(id, "reader closed the stream before its end")
            self._close(id)

    @asynccontextmanager
    async def push_stream(self, body: msgspec.Struct, deadline: float) -> AsyncIterator[StreamSink]:
        id, waiter = self._open(1, deadline, f"stream to {self.peer}")
        sink = StreamSink(self, id, waiter, deadline)
        try:
            await self.conn.send(Push(id, body, relative_timeout(deadline)), deadline=deadline)
            try:
                yield sink
            except BaseException as exc:
                if self.alive:
                    await self._abandon(id, f"sender raised {type(exc).__name__}: {exc}")
                raise
            try:
                await sink.finish()
            except anyio.get_cancelled_exc_class():
                # Cancelled before End went out (a cancelled send does not write), or while
                # waiting for the answer: the server must not wait for an End that never comes.
                if self.alive and not sink.answered:
                    await self._abandon(id, "the sender was cancelled before its end")
                raise
        finally:
            self._close(id)
