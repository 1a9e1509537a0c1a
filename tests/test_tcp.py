"""mesh.tcp: the fast TCP streams keep anyio's stream semantics on trio and on asyncio."""

from __future__ import annotations

import asyncio
import random
import socket

import anyio
import anyio.abc
import pytest
import trio

from mesh import tcp
from mesh.tcp import BULK_READ, FAIR_READS, READ_BUFFER, TrioSocketStream, asyncio_stream
from tests.backends import backends_fixture

anyio_backend = backends_fixture(plain_asyncio=True)


def tcp_socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets (blocking, as the tests hand them over)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
    return left, right


async def connected_pair() -> tuple[anyio.abc.ByteStream, anyio.abc.ByteStream]:
    left, right = tcp_socket_pair()
    return await tcp.wrap_socket(left), await tcp.wrap_socket(right)


async def read_exactly(stream: anyio.abc.ByteStream, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        got += await stream.receive(1 << 20)
    return bytes(got)


@pytest.mark.anyio
async def test_bulk_bytes_arrive_whole_and_in_order() -> None:
    rng = random.Random(7)
    payload = rng.randbytes(6 * 1024 * 1024 + 13)
    left, right = await connected_pair()
    async with left, right, anyio.create_task_group() as group:

        async def write() -> None:
            pos = 0
            while pos < len(payload):
                size = rng.choice([1, 100, 70_000, 1 << 20])
                await left.send(payload[pos : pos + size])
                pos += size

        group.start_soon(write)
        assert await read_exactly(right, len(payload)) == payload


@pytest.mark.anyio
async def test_gathered_parts_arrive_whole_and_in_order() -> None:
    rng = random.Random(8)
    parts = [rng.randbytes(rng.choice([1, 30, 70_000, 1 << 20])) for _ in range(24)]
    left, right = await connected_pair()
    async with left, right, anyio.create_task_group() as group:

        async def write() -> None:
            for i in range(0, len(parts), 3):  # more than the socket takes at once
                await left.send_parts(tuple(memoryview(p) for p in parts[i : i + 3]))  # type: ignore[attr-defined]

        group.start_soon(write)
        with anyio.fail_after(20):
            got = await read_exactly(right, sum(map(len, parts)))
        assert got == b"".join(parts)


@pytest.mark.anyio
async def test_end_of_stream_after_the_data_and_the_other_half_still_works() -> None:
    left, right = await connected_pair()
    async with left, right:
        await left.send(b"last words")
        await left.send_eof()
        assert await read_exactly(right, 10) == b"last words"
        with pytest.raises(anyio.EndOfStream):
            await right.receive()
        await right.send(b"reply")
        assert await left.receive() == b"reply"


@pytest.mark.anyio
async def test_closing_wakes_a_waiting_reader_and_later_calls_fail() -> None:
    left, right = await connected_pair()
    failures: list[type[BaseException]] = []

    async def reader() -> None:
        try:
            await right.receive()
        except (anyio.ClosedResourceError, anyio.EndOfStream) as exc:
            failures.append(type(exc))

    async with left, anyio.create_task_group() as group:
        group.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        await right.aclose()
    assert failures in ([anyio.ClosedResourceError], [anyio.EndOfStream])
    with pytest.raises(anyio.ClosedResourceError):
        await right.send(b"x")
    with pytest.raises(anyio.ClosedResourceError):
        await right.receive()


@pytest.mark.anyio
async def test_a_reset_by_the_peer_breaks_the_stream() -> None:
    left, right = tcp_socket_pair()
    right_stream = await tcp.wrap_socket(right)
    # An abortive close: the peer's kernel answers further traffic with a reset.
    left.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    left.close()
    with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
        await right_stream.receive()
    with pytest.raises(anyio.BrokenResourceError):
        for _ in range(100):
            await right_stream.send(b"x" * 65536)
    await right_stream.aclose()


@pytest.mark.trio
async def test_a_reader_that_never_waits_still_lets_other_tasks_run() -> None:
    left, right = tcp_socket_pair()
    left.sendall(b"y" * (FAIR_READS * 4 * 100))
    stream = TrioSocketStream(right)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        # Every read finds 100 bytes at once, filling its request: no wait, no yield...
        for _ in range(FAIR_READS * 4):
            assert len(await stream.receive(100)) == 100
        # ...except every FAIR_READS-th one.
        assert ticks >= 3
        nursery.cancel_scope.cancel()
    await stream.aclose()
    left.close()


class FakeTransport:
    """Records pause/resume calls of the protocol under test."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_write_buffer_limits(self, high: int) -> None:
        self.calls.append(f"limits {high}")

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def connected_protocol() -> tuple[asyncio_stream._StreamProtocol, FakeTransport]:
    """The asyncio stream's protocol, connected to a FakeTransport."""
    protocol = asyncio_stream._StreamProtocol()
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


@pytest.mark.anyio
async def test_asyncio_reading_pauses_while_too_much_waits_unread() -> None:
    protocol, transport = connected_protocol()
    chunk = b"z" * (READ_BUFFER // 4)
    for _ in range(5):
        protocol.data_received(chunk)
    assert transport.calls == [f"limits {asyncio_stream.WRITE_BUFFER}", "pause"]
    stream = tcp.AsyncioSocketStream(transport, protocol)  # type: ignore[arg-type]
    for _ in range(3):
        assert await stream.receive(len(chunk)) == chunk
    # Below half the buffer again: the transport reads on.
    assert transport.calls[-1] == "resume"


@pytest.mark.anyio
async def test_asyncio_reads_into_the_readers_buffer_only_when_nothing_is_queued() -> None:
    protocol, transport = connected_protocol()
    stream = tcp.AsyncioSocketStream(transport, protocol)  # type: ignore[arg-type]
    target = bytearray(10)
    landed: list[int] = []

    def filled(count: int) -> bool:
        landed.append(count)
        return count == 4  # "a frame is ready": wake the reader

    stream.fill_into(lambda: memoryview(target), filled)
    # A chunk is queued: its bytes come first, so the next read goes to a chunk too.
    protocol.data_received(b"first")
    scratch = protocol.get_buffer(-1)
    assert scratch is not target and len(scratch) == asyncio_stream.SCRATCH
    scratch[:3] = b"abc"
    protocol.buffer_updated(3)
    assert await stream.receive() == b"first" and await stream.receive() == b"abc"
    # Nothing queued: the read lands in the reader's buffer, in place.
    into = protocol.get_buffer(-1)
    into[:2] = b"xy"
    protocol.buffer_updated(2)
    assert target[:2] == b"xy" and landed == [2] and not protocol.chunks
    into = protocol.get_buffer(-1)
    into[:4] = b"zzzz"
    protocol.buffer_updated(4)
    # filled() asked for the reader: an empty chunk wakes it.
    assert landed == [2, 4] and await stream.receive() == b""
    stream.fill_into(None, None)
    assert protocol.get_buffer(-1) is not target


@pytest.mark.anyio
async def test_asyncio_reads_into_the_readers_buffer_a_bulk_step_at_a_time() -> None:
    protocol, transport = connected_protocol()
    stream = tcp.AsyncioSocketStream(transport, protocol)  # type: ignore[arg-type]
    target = bytearray(3 * BULK_READ + 5)
    stream.fill_into(lambda: memoryview(target), lambda count: False)
    into = protocol.get_buffer(-1)
    assert len(into) == BULK_READ
    into[:] = b"s" * BULK_READ
    protocol.buffer_updated(BULK_READ)
    assert target[:BULK_READ] == b"s" * BULK_READ and not any(target[BULK_READ:])


@pytest.mark.trio
async def test_trio_reads_into_a_buffer_a_bulk_step_at_a_time() -> None:
    left, right = tcp_socket_pair()
    payload = random.Random(9).randbytes(4 * BULK_READ + 7)
    left.sendall(payload)
    left.close()
    stream = TrioSocketStream(right)
    buffer = bytearray(len(payload))
    got = 0
    async with stream:
        while got < len(payload):
            count = await stream.receive_into(memoryview(buffer)[got:])
            assert 0 < count <= BULK_READ
            got += count
    assert bytes(buffer) == payload


def test_asyncio_sends_that_never_wait_take_nothing_while_paused_and_fail_once_closed() -> None:
    async def main() -> None:
        left, right = tcp_socket_pair()
        stream = await asyncio_stream.AsyncioSocketStream.wrap(left)
        # Nobody reads the other end: the transport's buffer fills and writing pauses.
        taken = [stream.send_nowait(b"x" * 65536) for _ in range(200)]
        assert taken[0] == 65536 and taken[-1] == 0
        assert stream.send_parts_nowait((b"x" * 10, b"y")) == 0
        await stream.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            stream.send_nowait(b"x")
        with pytest.raises(anyio.ClosedResourceError):
            stream.send_parts_nowait((b"x",))
        right.close()

    asyncio.run(main())
