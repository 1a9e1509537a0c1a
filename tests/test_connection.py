"""Connection: framed envelopes over a byte stream, the Hello handshake, traffic counts."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
import trio
import trio.testing

from mesh.connection import Connection, client_handshake, server_handshake
from mesh.errors import FrameDecodeError, HandshakeError, PeerGone
from mesh.tcp import AsyncioSocketStream
from mesh.transport import Address, TcpTransport, memory_pipe
from mesh.wire import BULK_BYTES, Call, Cast, Codec, Envelope, Fail, Hello, Item, Reply
from tests.ping import Ping


class Blob(msgspec.Struct, frozen=True, tag=True):
    data: memoryview
    n: int = 0


CODEC = Codec([Ping, Blob])


def connected() -> tuple[Connection, Connection]:
    left, right = memory_pipe(8)
    return Connection(left, CODEC), Connection(right, CODEC)


@pytest.mark.trio
async def test_handshake_names_both_ends() -> None:
    client, server = connected()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server_handshake, server, "srv")
        await client_handshake(client, "cli")
    assert (client.peer, server.peer) == ("srv", "cli")


@pytest.mark.trio
async def test_server_refuses_another_protocol_version() -> None:
    client, server = connected()
    await client.send(Hello(99, "old"))
    with pytest.raises(HandshakeError, match="protocol=99"):
        await server_handshake(server, "srv")
    # The refusal travels back as a Fail frame naming the reason.
    refusal = await client.receive()
    assert isinstance(refusal, Fail) and "protocol=99" in refusal.detail


@pytest.mark.trio
async def test_client_reports_a_refused_handshake() -> None:
    client, server = connected()
    await server.send(Fail(0, "HandshakeError", "protocol=1, this server speaks 2"))
    with pytest.raises(HandshakeError, match="refused the handshake"):
        await client_handshake(client, "cli")


@pytest.mark.trio
async def test_first_frame_must_be_hello() -> None:
    client, server = connected()
    await client.send(Call(1, Ping(1)))
    with pytest.raises(HandshakeError, match="expected Hello as first frame, got Call"):
        await server_handshake(server, "srv")


@pytest.mark.trio
async def test_frames_and_bytes_are_counted_both_ways() -> None:
    client, server = connected()
    await client.send(Call(1, Ping(5)))
    await client.send(Call(2, Ping(6)))
    assert await server.receive() == Call(1, Ping(5))
    assert await server.receive() == Call(2, Ping(6))
    await server.send(Reply(1, None))
    assert await client.receive() == Reply(1, None)
    sent, got = client.statistics(), server.statistics()
    assert (sent.frames_out, got.frames_in) == (2, 2)
    assert sent.bytes_out == got.bytes_in > 0
    assert (got.frames_out, sent.frames_in) == (1, 1)


@pytest.mark.trio
async def test_receive_after_peer_closed_is_peer_gone() -> None:
    client, server = connected()
    await server.aclose()
    with pytest.raises(PeerGone, match="ended"):
        await client.receive()
    with pytest.raises(PeerGone, match="send to"):
        await client.send(Reply(1, None))
    assert client.closed


@pytest.mark.trio
async def test_memory_streams_deliver_directly_in_the_senders_task() -> None:
    """A frame sent while nothing is queued goes to the route at once, unread by `receive`;
    one that finds the route failing is queued, and `receive` then raises the failure."""
    client, server = connected()
    routed: list[Envelope] = []
    assert client.deliver_directly(routed.append)
    await server.send(Reply(1, Ping(1)))
    await server.send(Cast(Ping(2)), urgent=False)
    assert routed == [Reply(1, Ping(1)), Cast(Ping(2))]
    assert client.statistics().frames_in == 2

    def refuse(envelope: Envelope) -> None:
        raise FrameDecodeError(f"no waiter for {envelope}")

    client.deliver_directly(refuse)
    await server.send(Reply(2, Ping(3)))
    with pytest.raises(FrameDecodeError, match="no waiter"):
        await client.receive()


@pytest.mark.trio
async def test_memory_direct_delivery_keeps_order_behind_a_queued_chunk() -> None:
    """Chunks already queued for `receive` keep their place: while one waits, later ones
    queue behind it instead of reaching the route first."""
    client, server = connected()
    await server.send(Reply(1, Ping(1)))
    routed: list[Envelope] = []
    client.deliver_directly(routed.append)
    await server.send(Reply(2, Ping(2)))
    assert routed == []
    assert await client.receive() == Reply(1, Ping(1))
    assert await client.receive() == Reply(2, Ping(2))
    client.deliver_directly(None)
    await server.send(Reply(3, Ping(3)))
    assert routed == [] and await client.receive() == Reply(3, Ping(3))


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    # Direct delivery is asyncio's (mesh.tcp); uvloop is the live default.
    return ("asyncio", {"use_uvloop": True})


async def tcp_connections() -> tuple[Connection, Connection]:
    bound = await TcpTransport().listen(Address("127.0.0.1", 0))
    accepted: list[anyio.abc.ByteStream] = []

    async def keep(stream: anyio.abc.ByteStream) -> None:
        accepted.append(stream)

    async with bound.listener, anyio.create_task_group() as group:
        group.start_soon(bound.listener.serve, keep)
        client = await TcpTransport().connect(bound.address)
        with anyio.fail_after(5):
            while not accepted:
                await anyio.sleep(0)
        group.cancel_scope.cancel()
    return Connection(client, CODEC), Connection(accepted[0], CODEC)


@pytest.mark.anyio
async def test_direct_delivery_skips_receive_and_reports_errors_through_it() -> None:
    client, server = await tcp_connections()
    got: list[Envelope] = []

    def route(envelope: Envelope) -> None:
        if isinstance(envelope, Reply) and envelope.id == 0:
            raise FrameDecodeError("reply 0 is not allowed here")
        got.append(envelope)

    assert server.deliver_directly(route)
    await client.send(Reply(1, Ping(1)))
    await client.send(Reply(2, Ping(2)))
    with anyio.fail_after(5):
        while len(got) < 2:
            await anyio.sleep(0)
    assert got == [Reply(1, Ping(1)), Reply(2, Ping(2))]
    assert server.statistics().frames_in == 2
    # A frame the route refuses ends direct delivery: the next receive raises its error.
    await client.send(Reply(0, None))
    with anyio.fail_after(5), pytest.raises(FrameDecodeError, match="reply 0"):
        await server.receive()
    # Off again: frames come through receive.
    server.deliver_directly(None)
    await client.aclose()
    await server.aclose()


@pytest.mark.parametrize("anyio_backend", [("trio", {}), ("asyncio", {"use_uvloop": True}),
                                           ("asyncio", {})], ids=["trio", "uvloop", "asyncio"])
@pytest.mark.anyio
async def test_bulk_frames_sent_in_parts_arrive_whole_between_small_ones() -> None:
    client, server = await tcp_connections()
    payloads = [bytes([i]) * (BULK_BYTES + i * 99_991) for i in range(1, 9)]
    sent: list[Envelope] = []
    for i, payload in enumerate(payloads):
        sent += [Item(i, Blob(memoryview(payload), i)), Cast(Ping(i))]
    read_in_place = count_reads_in_place(server)
    # A bulk frame last: nothing after it wakes the reader but the frame itself.
    sent += [Item(100, Blob(memoryview(b"L" * (9 * BULK_BYTES))))]
    got: list[Envelope] = []

    async def read() -> None:
        while len(got) < len(sent):
            got.append(await server.receive())

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(client.run_writer)
                group.start_soon(read)
                for envelope in sent:
                    await client.send(envelope, urgent=isinstance(envelope, Cast))
                while len(got) < len(sent):
                    await anyio.sleep(0.001)
                group.cancel_scope.cancel()
    finally:
        await client.aclose()
        await server.aclose()
    assert got == sent
    assert client.statistics().bytes_out == server.statistics().bytes_in
    assert read_in_place[0] > 0  # the bulk frames' rest went straight into their buffers


def count_reads_in_place(conn: Connection) -> list[int]:
    """Counts the reads that land in a bulk frame's own buffer (trio and asyncio streams)."""
    count = [0]
    stream = conn._stream
    if isinstance(stream, AsyncioSocketStream):
        filled = conn._filled

        def counting_filled(n: int) -> bool:
            count[0] += 1
            return filled(n)

        stream.fill_into(conn._fill_into, counting_filled)
    else:
        receive_into = conn._receive_into
        assert receive_into is not None

        async def counting_receive_into(view: memoryview) -> int:
            count[0] += 1
            return await receive_into(view)

        conn._receive_into = counting_receive_into
    return count


@pytest.mark.anyio
async def test_direct_delivery_takes_bulk_frames_read_in_place_in_order() -> None:
    client, server = await tcp_connections()
    got: list[Envelope] = []

    def route(envelope: Envelope) -> None:
        if isinstance(envelope, Item) and envelope.id == 99:
            raise FrameDecodeError("item 99 is not allowed here")
        got.append(envelope)

    read_in_place = count_reads_in_place(server)
    assert server.deliver_directly(route)
    sent: list[Envelope] = []
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(client.run_writer)
            try:
                for i in range(6):
                    item = Item(i, Blob(memoryview(bytes([i]) * (5 * BULK_BYTES + i)), i))
                    await client.send(item, urgent=False)
                    await client.send(Cast(Ping(i)))
                    sent += [item, Cast(Ping(i))]
                with anyio.fail_after(10):
                    while len(got) < len(sent):
                        await anyio.sleep(0.001)
                assert got == sent and read_in_place[0] > 0
                assert server.statistics().frames_in == len(sent)
                # A bulk frame the route refuses: the next receive raises the route's error.
                await client.send(Item(99, Blob(memoryview(b"r" * (32 * BULK_BYTES)))),
                                  urgent=False)
                with anyio.fail_after(10), pytest.raises(FrameDecodeError, match="item 99"):
                    await server.receive()
            finally:
                group.cancel_scope.cancel()
    finally:
        await client.aclose()
        await server.aclose()


@pytest.mark.trio
async def test_deferred_frames_on_an_in_memory_pipe_are_written_by_their_senders() -> None:
    """On the in-memory pipe (no system call to save) a deferred frame goes out like an
    urgent one, in order, with no wake-up of the writer task; a full pipe queues it for
    the writer as before."""
    left, right = memory_pipe(2)
    conn = Connection(left, CODEC)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run_writer)
        await trio.testing.wait_all_tasks_blocked()
        await conn.send(Item(1, Ping(1)), urgent=False)
        await conn.send(Cast(Ping(2)), urgent=False)
        assert right._incoming.statistics().depth == 2  # in the pipe, not the outbox
        await conn.send(Item(1, Ping(3)), urgent=False)
        assert conn.statistics().queued_bytes > 0  # the pipe is full: the writer's job
        reader = Connection(right, CODEC)
        got = [await reader.receive() for _ in range(3)]
        assert got == [Item(1, Ping(1)), Cast(Ping(2)), Item(1, Ping(3))]
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_deliver_some_leaves_a_declined_frame_and_those_after_it_to_receive() -> None:
    """The route takes what it can in the sender's task; a frame it declines, and every frame
    after it, reach `receive` in order (the reader woken by an empty chunk)."""
    near, far = memory_pipe(8)
    client = Connection(near, CODEC)
    routed: list[Envelope] = []

    def route(envelope: Envelope) -> bool:
        if isinstance(envelope, Reply) and envelope.id % 2:
            routed.append(envelope)
            return True
        return False

    def frame(n: int) -> bytes:
        return bytes(CODEC.encode(Reply(n, Ping(n))))

    assert client.deliver_some(route)
    await far.send(frame(1))
    await far.send(frame(2) + frame(3))
    assert routed == [Reply(1, Ping(1))]
    assert await client.receive() == Reply(2, Ping(2))
    assert await client.receive() == Reply(3, Ping(3))
    await far.send(frame(5))
    assert routed[-1] == Reply(5, Ping(5))
    assert client.statistics().frames_in == 4
    # A reader already waiting is woken for a frame the route declines.
    got: list[Envelope] = []

    async def read() -> None:
        got.append(await client.receive())

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await far.send(frame(6))
    assert got == [Reply(6, Ping(6))]
