"""Outbox: urgent frames go out at once, deferred ones in batches, always in order."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
import trio
import trio.testing

from mesh.errors import DeadlineExceeded, PeerGone
from mesh.outbox import BIG_FRAME, Outbox


class RecordingStream(anyio.abc.ByteStream):
    """Records each write; `gate` (when set) holds writes until it is opened."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.gate: trio.Event | None = None
        self.fail = False
        self.closed = False

    async def send(self, item: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise anyio.BrokenResourceError
        self.writes.append(bytes(item))

    async def receive(self, max_bytes: int = 65536) -> bytes:
        raise NotImplementedError

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.closed = True

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return {}


def recorded_outbox(
    limit: int, *, gated: bool = False, fail: bool = False
) -> tuple[RecordingStream, Outbox]:
    """An outbox to "peer" over a RecordingStream whose writes wait for its gate (`gated`) or
    fail (`fail`)."""
    stream = RecordingStream()
    stream.gate = trio.Event() if gated else None
    stream.fail = fail
    return stream, Outbox(stream, "peer", limit=limit)


def frames(n: int, size: int = 10) -> list[bytes]:
    return [bytes([i % 256]) * size for i in range(n)]


@asynccontextmanager
async def writing(outbox: Outbox) -> AsyncIterator[None]:
    """`outbox` with its writer task started and waiting; leaving the block stops it."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        await trio.testing.wait_all_tasks_blocked()
        yield
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_urgent_frame_is_written_at_once_without_a_writer_task() -> None:
    stream, outbox = recorded_outbox(1000)
    await outbox.put(b"hello", urgent=True)
    assert stream.writes == [b"hello"]


@pytest.mark.trio
async def test_deferred_frames_are_batched_in_order() -> None:
    stream, outbox = recorded_outbox(1 << 20)
    sent = frames(500)
    async with writing(outbox):
        for frame in sent:
            await outbox.put(frame, urgent=False)
            outbox.check_integrity()
        await outbox.put(b"last", urgent=True)
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"".join([*sent, b"last"])
    assert len(stream.writes) < 10
    assert outbox.queued_bytes == 0


@pytest.mark.trio
async def test_big_frames_are_written_alone() -> None:
    stream, outbox = recorded_outbox(1 << 24)
    big = b"B" * BIG_FRAME
    async with writing(outbox):
        for frame in (b"a", big, b"b", big):
            await outbox.put(frame, urgent=False)
        await trio.testing.wait_all_tasks_blocked()
    assert stream.writes == [b"a", big, b"b", big]


@pytest.mark.trio
async def test_a_frame_in_parts_is_written_in_order_between_its_neighbours() -> None:
    stream, outbox = recorded_outbox(1 << 24)
    big = b"B" * BIG_FRAME
    async with writing(outbox):
        await outbox.put(b"a", urgent=False)
        await outbox.put((b"head", memoryview(big), b"tail"), urgent=False)
        outbox.check_integrity()
        await outbox.put(b"b", urgent=True)
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"a" + b"head" + big + b"tail" + b"b"
    assert big in stream.writes  # the bulk part alone, never joined
    assert outbox.queued_bytes == 0


@pytest.mark.trio
async def test_full_queue_makes_deferred_senders_wait_until_their_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream, outbox = recorded_outbox(25, gated=True)
    expired: list[float] = []
    async with writing(outbox):
        await outbox.put(b"x" * 10, urgent=False)  # taken by the writer, held at the gate
        await trio.testing.wait_all_tasks_blocked()
        for frame in frames(3):  # 30 bytes queued: over the limit of 25
            await outbox.put(frame, urgent=False)
            outbox.check_integrity()
        with pytest.raises(DeadlineExceeded, match="send to peer"):
            await outbox.put(b"late", urgent=False, deadline=trio.current_time() + 5)
        expired.append(trio.current_time())
        stream.gate.set()
        await trio.testing.wait_all_tasks_blocked()
    assert expired == [5.0]
    # The send that gave up sent nothing.
    assert b"".join(stream.writes) == b"x" * 10 + b"".join(frames(3))


@pytest.mark.trio
async def test_broken_stream_fails_later_sends_and_closes_it() -> None:
    stream, outbox = recorded_outbox(1000, fail=True)
    async with writing(outbox):
        await outbox.put(b"lost", urgent=False)
        await trio.testing.wait_all_tasks_blocked()
    assert stream.closed
    with pytest.raises(PeerGone, match="send to peer failed"):
        await outbox.put(b"more", urgent=True)


@pytest.mark.trio
async def test_cancel_inside_a_write_breaks_the_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream, outbox = recorded_outbox(1000, gated=True)
    with trio.move_on_after(1):
        await outbox.put(b"half", urgent=True)
    assert stream.closed
    assert outbox.broken is not None and "cancelled part-way" in str(outbox.broken)


@pytest.mark.trio
async def test_cancel_before_a_write_leaves_the_connection_whole() -> None:
    stream, outbox = recorded_outbox(1000)
    with trio.CancelScope() as scope:
        scope.cancel()
        await outbox.put(b"never", urgent=True)
    assert outbox.broken is None and stream.writes == []
    await outbox.put(b"next", urgent=True)
    assert stream.writes == [b"next"]


class NowaitStream(RecordingStream):
    """Takes at most `room` bytes per immediate write, like a socket with a small buffer."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.nowait: list[bytes] = []

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        if self.fail:
            raise anyio.BrokenResourceError
        taken = bytes(data[: self.room])
        self.nowait.append(taken)
        self.writes.append(taken)
        return len(taken)


@pytest.mark.trio
async def test_put_nowait_writes_at_once_and_the_rest_waits_first_in_line() -> None:
    stream = NowaitStream(room=4)
    outbox = Outbox(stream, "peer", limit=1000)
    # No writer task yet: nobody would finish a partial write, so the caller must `put`.
    assert not outbox.put_nowait(b"early")
    async with writing(outbox):
        assert outbox.put_nowait(b"abcdefghij")
        assert stream.nowait == [b"abcd"]
        outbox.check_integrity()
        assert outbox.queued_bytes == 6
        # Something is queued now: later frames queue behind it, in order.
        assert not outbox.put_nowait(b"next")
        await outbox.put(b"next", urgent=True)
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"abcdefghijnext"
    assert outbox.queued_bytes == 0


@pytest.mark.trio
async def test_put_nowait_on_a_broken_stream_breaks_the_outbox() -> None:
    stream = NowaitStream(room=100)
    stream.fail = True
    outbox = Outbox(stream, "peer", limit=1000)
    async with writing(outbox):
        with pytest.raises(PeerGone, match="send to peer failed"):
            outbox.put_nowait(b"lost")
    assert outbox.broken is not None


class PartsStream(RecordingStream):
    """Takes at most `room` bytes per immediate gathering write, the rest when waited for;
    `inline` records what each immediate write took, `waited` each waiting write."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.inline: list[bytes] = []
        self.waited: list[bytes] = []

    def send_parts_nowait(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> int:
        if self.fail:
            raise anyio.BrokenResourceError
        taken = b"".join(bytes(part) for part in parts)[: self.room]
        self.inline.append(taken)
        self.writes.append(taken)
        return len(taken)

    async def send_parts(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        await trio.lowlevel.checkpoint()
        joined = b"".join(bytes(part) for part in parts)
        self.waited.append(joined)
        self.writes.append(joined)


def bulk_frame(seq: int, size: int = BIG_FRAME) -> tuple[bytes, memoryview, bytes]:
    return (b"head%d" % seq, memoryview(bytes([seq % 256]) * size), b"tail")


@pytest.mark.trio
async def test_a_frame_in_parts_is_written_by_its_sender_when_nothing_is_ahead() -> None:
    stream = PartsStream(room=1 << 20)
    outbox = Outbox(stream, "peer", limit=1 << 24)
    async with writing(outbox):
        await outbox.put(bulk_frame(1), urgent=False)
        # Written before any other task ran: no hand-off to the writer.
        assert stream.inline == [b"".join(bulk_frame(1))]
        assert outbox.queued_bytes == 0
    assert stream.waited == []


@pytest.mark.trio
async def test_what_the_socket_does_not_take_at_once_waits_first_in_line() -> None:
    stream = PartsStream(room=BIG_FRAME // 2 + 3)
    outbox = Outbox(stream, "peer", limit=1 << 24)
    first, second = bulk_frame(1), bulk_frame(2)
    async with writing(outbox):
        await outbox.put(first, urgent=False)
        outbox.check_integrity()
        assert outbox.queued_bytes == sum(map(len, first)) - stream.room
        # The rest of the first frame is queued: the second goes behind it, not inline.
        await outbox.put(second, urgent=True)
        outbox.check_integrity()
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"".join(first) + b"".join(second)
    assert len(stream.inline) == 1 and len(stream.waited) == 2
    assert outbox.queued_bytes == 0


@pytest.mark.trio
async def test_a_frame_in_parts_goes_behind_queued_frames() -> None:
    stream = PartsStream(room=1 << 20)
    outbox = Outbox(stream, "peer", limit=1 << 24)
    async with writing(outbox):
        await outbox.put(b"small", urgent=False)  # queued: the writer has not run yet
        await outbox.put(bulk_frame(1), urgent=False)
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"small" + b"".join(bulk_frame(1))
    assert stream.inline == []


@pytest.mark.trio
async def test_a_sender_of_frames_in_parts_yields_once_per_limit_and_a_cancel_sends_nothing(
) -> None:
    stream = PartsStream(room=1 << 20)
    size = sum(map(len, bulk_frame(0)))
    outbox = Outbox(stream, "peer", limit=3 * size)
    sent = 0
    async with writing(outbox):
        with trio.CancelScope() as scope:
            scope.cancel()
            for seq in range(10):
                await outbox.put(bulk_frame(seq), urgent=False)
                sent += 1
    # Three frames fill the limit; the fourth put yields first, sees the cancel, sends nothing.
    assert sent == 3
    assert b"".join(stream.writes) == b"".join(b"".join(bulk_frame(seq)) for seq in range(3))
    assert outbox.broken is None


@pytest.mark.trio
async def test_a_broken_stream_fails_the_sender_of_a_frame_in_parts() -> None:
    stream = PartsStream(room=1 << 20)
    stream.fail = True
    outbox = Outbox(stream, "peer", limit=1 << 24)
    async with writing(outbox):
        with pytest.raises(PeerGone, match="send to peer failed"):
            await outbox.put(bulk_frame(1), urgent=False)
    assert outbox.broken is not None


@pytest.mark.trio
async def test_small_frames_queued_behind_the_short_rest_of_a_frame_in_parts_are_written(
) -> None:
    # The socket takes all of a frame in parts but a rest shorter than BIG_FRAME; the frames
    # put before the writer runs queue behind that rest. Joined into one batch with it, they
    # were dropped (a push stream's End lost: the trio stream that hung, issue 29).
    frame = bulk_frame(1)
    stream = PartsStream(room=sum(map(len, frame)) - 100)
    outbox = Outbox(stream, "peer", limit=1 << 24)
    async with writing(outbox):
        await outbox.put(frame, urgent=False)
        await outbox.put(b"item", urgent=False)
        await outbox.put(b"end", urgent=True)
        outbox.check_integrity()
        await trio.testing.wait_all_tasks_blocked()
    assert b"".join(stream.writes) == b"".join(frame) + b"item" + b"end"
    assert outbox.queued_bytes == 0
