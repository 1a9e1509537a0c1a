"""Outbox: orders and writes one connection's outgoing frames.

Three ways out, one order:

* urgent frames (calls, replies, stream ends) are written at once by the sending task when
  nothing else is queued or being written: no hand-off to another task, so request/reply
  latency stays at one socket write. On streams that can write without waiting (mesh.tcp)
  this is a plain call (`put_nowait`), and whatever the socket does not take at once waits
  at the head of the queue for the writer task. Elsewhere the sender awaits the write; a
  frame cut in half by a cancellation would desynchronise the peer's parser, so such a
  cancellation breaks the connection instead.
* deferred frames (casts, stream items) are queued and the sender returns; the writer task
  (`run`) joins small queued frames into one write of up to BATCH_BYTES, so a burst of small
  messages costs one system call per batch, not per message (docs/engineering-notes.md 3a
  and 3d). Large frames go out
  alone, unjoined, to avoid a copy. A sender waits only when more than `limit` bytes are
  queued.
* a frame in parts (a bulk payload cut out of it, `mesh.wire.Codec.encode_parts`) is written
  by its sender, urgent or not, while nothing is queued or being written: one gathering
  write of what the socket takes at once, the rest first in line for the writer task. A bulk
  stream then costs no hand-off between tasks per frame while the socket keeps up. A frame
  in parts, or the rest of one, is never joined with others: the writer writes it alone.

When no writer task runs (during the handshake, or a bare Connection in a test), senders
write their own frames.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import anyio
import anyio.abc
import anyio.lowlevel

from mesh.deadlines import deadline_scope
from mesh.errors import PeerGone
from mesh.native import checkpoint_if_cancelled

Frame = bytes | bytearray | memoryview
# One frame as buffers to write in order (mesh.wire.Codec.encode_parts), uncopied.
Parts = tuple[Frame, ...]


@runtime_checkable
class SendsNowait(Protocol):
    """A stream that can write part or all of a buffer at once, without waiting."""

    def send_nowait(self, data: Frame) -> int: ...


@runtime_checkable
class SendsParts(Protocol):
    """A stream that writes several buffers as one (a gathering write), without joining:
    all of them, waiting for room, or what the socket takes at once (how many bytes)."""

    async def send_parts(self, parts: Parts) -> None: ...

    def send_parts_nowait(self, parts: Parts) -> int: ...


@runtime_checkable
class InMemory(Protocol):
    """A stream whose writes are hand-offs in memory, not system calls (mesh.transport's
    in-memory pipe): joining small frames saves nothing there, so deferred frames too are
    written by their senders while nothing is ahead of them, as urgent ones are, instead of
    waking the writer task for each."""

    in_memory: bool


def _size(entry: Frame | Parts) -> int:
    return sum(len(part) for part in entry) if isinstance(entry, tuple) else len(entry)


def _unsent(parts: Parts, sent: int) -> Parts:
    """What is left of `parts` once their first `sent` bytes are written."""
    rest = list(parts)
    while sent >= len(rest[0]):
        sent -= len(rest.pop(0))
    rest[0] = memoryview(rest[0])[sent:]
    return tuple(rest)


STREAM_ERRORS = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
BATCH_BYTES = 256 * 1024
# Frames this big are written alone: joining them would copy more than it saves.
BIG_FRAME = 64 * 1024


async def _no_checkpoint() -> None:
    """Stands in for the check on loops that need none (mesh.native)."""


class _Signal:
    """A wake-up for tasks waiting on a condition they re-check after waking."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


class Outbox:
    """The outgoing side of a connection: a bounded frame queue and its writer."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        peer: str,
        limit: int,
        on_deadline: Callable[[], None] | None = None,
    ) -> None:
        self.peer = peer
        self._on_deadline = on_deadline
        self.broken: PeerGone | None = None
        self._stream = stream
        self._limit = limit
        self._queue: deque[Frame | Parts] = deque()
        self._queued = 0
        self._writing = False
        self._writer_running = False
        self._work = _Signal()
        self._drained = _Signal()
        # The loop's own checkpoint, looked up on first use (anyio's looks it up every time).
        self._checkpoint: Callable[[], Awaitable[None]] | None = None
        self._send_nowait = stream.send_nowait if isinstance(stream, SendsNowait) else None
        self._parts_stream = stream if isinstance(stream, SendsParts) else None
        # Deferred frames written like urgent ones (`InMemory`); False keeps them batched.
        self.inline_deferred = isinstance(stream, InMemory) and stream.in_memory
        # Bytes of frames in parts written by their senders since one of them last yielded.
        self._inline = 0

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def check_integrity(self) -> None:
        """Asserts the queue accounting (tests call it after each operation)."""
        assert self._queued == sum(_size(entry) for entry in self._queue), "queued bytes drifted"
        assert self._queued >= 0

    def put_nowait(self, frame: Frame) -> bool:
        """Writes an urgent frame now, without waiting, when nothing is ahead of it.

        False (nothing done) where that cannot be: call `put`. The part of the frame the
        socket does not take at once is queued first in line for the writer task.
        """
        send = self._send_nowait
        if send is None or not self._writer_running or self._writing or self._queue:
            return False
        if self.broken is not None:
            raise self.broken
        if len(frame) >= BIG_FRAME:
            return False
        try:
            sent = send(frame)
        except STREAM_ERRORS as exc:
            self.broken = PeerGone(f"send to {self.peer} failed: {exc!r}")
            raise self.broken from exc
        if sent < len(frame):
            rest = memoryview(frame)[sent:]
            self._queue.append(rest)
            self._queued += len(rest)
            self._work.fire()
        return True

    async def put(self, frame: Frame | Parts, *, urgent: bool,
                  deadline: float = math.inf) -> None:
        """Writes or queues `frame` after every frame put before it; PeerGone once broken.
        A tuple is one frame in parts (`Codec.encode_parts`), urgent or not: written by this
        task while nothing is ahead of it, where the stream can write without waiting
        (`SendsParts`); otherwise queued, then written with one gathering write where the
        stream has one, else part by part.

        Waits (until `deadline`, then DeadlineExceeded, the frame unsent) only while the queue
        is over its limit.
        """
        if self.broken is not None:
            raise self.broken
        size = _size(frame)
        if isinstance(frame, tuple):
            if await self._put_parts_inline(frame, size):
                return
        elif urgent and not self._writing and not self._queue and size < BIG_FRAME:
            await self._write_now(frame)
            return
        if self._queued > self._limit and self._writer_running:
            # Wait for room before queueing: a send that gives up has sent nothing.
            with deadline_scope(deadline, f"send to {self.peer}", self._on_deadline):
                while self._queued > self._limit and self.broken is None:
                    await self._drained.wait()
            if self.broken is not None:
                raise self.broken
        self._queue.append(frame)
        self._queued += size
        if not self._writer_running:
            await self._write_queue_here()
        self._work.fire()

    async def _put_parts_inline(self, parts: Parts, size: int) -> bool:
        """Writes a frame in parts from the sending task while nothing is queued or being
        written and the writer task runs: what the socket takes at once goes now, the rest
        first in line for the writer. While the socket keeps up, a bulk stream costs no
        hand-off between tasks per frame. False (nothing done) where that cannot be.

        The sender yields before each `limit` bytes so written, as a queue that full would
        have made it wait (other tasks run; a cancel then sends nothing).
        """
        stream = self._parts_stream
        if stream is None or not self._writer_running:
            return False
        if self._inline >= self._limit:
            self._inline = 0
            await anyio.lowlevel.checkpoint()
            if self.broken is not None:
                raise self.broken
        if self._writing or self._queue:
            return False
        try:
            sent = stream.send_parts_nowait(parts)
        except STREAM_ERRORS as exc:
            self.broken = PeerGone(f"send to {self.peer} failed: {exc!r}")
            raise self.broken from exc
        self._inline += size
        if sent < size:
            self._queue.append(_unsent(parts, sent))
            self._queued += size - sent
            self._work.fire()
        return True

    async def _write_now(self, frame: Frame) -> None:
        # No shield (a cancel scope costs as much as the write): a cancel that lands before
        # the write is harmless, and one that lands inside it (only when a write blocks)
        # may have cut the frame, so the connection is broken rather than desynchronised.
        if self._checkpoint is None:
            self._checkpoint = checkpoint_if_cancelled() or _no_checkpoint
        if self._checkpoint is not _no_checkpoint:
            await self._checkpoint()
        self._writing = True
        try:
            # Streams take any buffer (typed bytes); a frame is never reused once sent (G8).
            await self._stream.send(frame)  # type: ignore[arg-type]
        except STREAM_ERRORS as exc:
            self.broken = PeerGone(f"send to {self.peer} failed: {exc!r}")
            raise self.broken from exc
        except anyio.get_cancelled_exc_class():
            self.broken = PeerGone(f"send to {self.peer} was cancelled part-way")
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
            raise
        finally:
            self._writing = False
            self._drained.fire()
        if self._queue:
            # Frames deferred while we wrote: the writer skipped them and waits to be told.
            self._work.fire()

    async def run(self) -> None:
        """The writer task: flushes queued frames until the connection breaks or is closed."""
        self._writer_running = True
        try:
            while self.broken is None:
                if self._writing or not self._queue:
                    await self._work.wait()
                    continue
                await self._write(self._take_batch())
        except PeerGone:
            # Close the stream so that the reader, maybe blocked on it, ends the session too.
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
        finally:
            self._writer_running = False

    def _take_batch(self) -> Parts | list[Frame]:
        """The next write: a frame in parts alone, or whole frames, small ones joined up to
        BATCH_BYTES. A frame in parts is never joined, whatever its size: the rest of one
        the socket cut short may be small, and the frames queued behind it are written by
        the next write, not dropped (a push stream's End was: docs/engineering-notes.md,
        "The stream that hung on trio")."""
        first = self._queue.popleft()
        if isinstance(first, tuple):
            self._queued -= _size(first)
            return first
        batch = [first]
        size = len(first)
        while self._queue and size < BATCH_BYTES and size < BIG_FRAME:
            frame = self._queue[0]
            if isinstance(frame, tuple) or len(frame) >= BIG_FRAME:
                break
            self._queue.popleft()
            batch.append(frame)
            size += len(frame)
        self._queued -= size
        return batch

    async def _write_queue_here(self) -> None:
        with anyio.CancelScope(shield=True):
            while self._queue and not self._writing:
                await self._write(self._take_batch())

    async def _write(self, batch: Parts | list[Frame]) -> None:
        self._writing = True
        try:
            if isinstance(batch, tuple):
                if self._parts_stream is not None:
                    await self._parts_stream.send_parts(batch)
                else:
                    for part in batch:
                        await self._stream.send(part)  # type: ignore[arg-type]
                return
            data = batch[0] if len(batch) == 1 else b"".join(batch)
            # Streams take any buffer (typed bytes); a frame is never reused once sent (G8).
            await self._stream.send(data)  # type: ignore[arg-type]
        except STREAM_ERRORS as exc:
            self.broken = PeerGone(f"send to {self.peer} failed: {exc!r}")
            raise self.broken from exc
        finally:
            self._writing = False
            self._drained.fire()
