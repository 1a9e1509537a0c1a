"""Transports: the memory and TCP implementations behave alike behind one interface."""

from __future__ import annotations

import anyio
import anyio.abc
import pytest

from mesh.errors import ConfigError
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport, Transport, memory_pipe
from tests.backends import backends_fixture

LOCAL = Address("127.0.0.1", 0)


anyio_backend = backends_fixture()


async def echo_once(transport: Transport) -> tuple[bytes, Address]:
    """Listens, connects, sends 'ping' and reads the echoed bytes back."""
    bound = await transport.listen(LOCAL)

    async def echo(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await stream.send(await stream.receive())

    async with bound.listener, anyio.create_task_group() as group:
        group.start_soon(bound.listener.serve, echo)
        async with await transport.connect(bound.address) as client:
            await client.send(b"ping")
            reply = await client.receive()
            with pytest.raises(anyio.EndOfStream):
                await client.receive()
        group.cancel_scope.cancel()
    return reply, bound.address


@pytest.mark.anyio
async def test_tcp_echo_and_end_of_stream() -> None:
    reply, address = await echo_once(TcpTransport())
    assert reply == b"ping"
    assert address.port > 0


@pytest.mark.trio
async def test_memory_echo_and_end_of_stream(memory_hub: MemoryHub) -> None:
    reply, address = await echo_once(MemoryTransport(memory_hub))
    assert reply == b"ping"
    assert address.port >= 49152


@pytest.mark.trio
async def test_memory_refuses_unknown_address_and_double_bind(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    with pytest.raises(ConnectionRefusedError, match="nothing listens"):
        await transport.connect(Address("a", 1))
    bound = await transport.listen(Address("a", 1))
    with pytest.raises(ConfigError, match="already bound"):
        await transport.listen(Address("a", 1))
    await bound.listener.aclose()
    # Closing the listener frees its address.
    again = await transport.listen(Address("a", 1))
    await again.listener.aclose()


@pytest.mark.trio
async def test_tcp_refuses_when_nobody_listens() -> None:
    bound = await TcpTransport().listen(LOCAL)
    await bound.listener.aclose()
    with pytest.raises(OSError):
        await TcpTransport().connect(bound.address)


@pytest.mark.trio
async def test_memory_pipe_passes_buffers_without_copy_and_splits_on_max_bytes() -> None:
    left, right = memory_pipe(4)
    frame = bytearray(b"abcdef")
    await left.send(frame)
    assert await right.receive(4) == b"abcd"
    assert await right.receive() == b"ef"
    await left.send(frame)
    assert await right.receive() is frame


@pytest.mark.trio
async def test_memory_pipe_send_nowait_takes_all_or_nothing() -> None:
    left, right = memory_pipe(2)
    assert [left.send_nowait(b"ab"), left.send_nowait(b"cd")] == [2, 2]
    assert left.send_nowait(b"ef") == 0  # full: nothing taken
    assert await right.receive() == b"ab"
    assert left.send_nowait(b"ef") == 2
    assert [await right.receive(), await right.receive()] == [b"cd", b"ef"]
    await right.aclose()
    with pytest.raises(anyio.BrokenResourceError):
        left.send_nowait(b"x")


@pytest.mark.trio
async def test_memory_pipe_offers_chunks_to_the_receivers_consumer_while_none_is_queued(
) -> None:
    left, right = memory_pipe(4)
    taken: list[bytes | bytearray] = []

    def consumer(chunk: bytes | bytearray) -> bool:
        taken.append(chunk)
        return chunk != b"no"

    right.deliver_to(consumer)
    await left.send(b"a")
    assert left.send_nowait(b"b") == 1
    assert taken == [b"a", b"b"]
    await left.send(b"no")  # refused: queued for receive, and what follows queues behind it
    await left.send(b"c")
    assert taken == [b"a", b"b", b"no"]
    assert [await right.receive(), await right.receive()] == [b"no", b"c"]
    right.deliver_to(None)
    await left.send(b"d")
    assert await right.receive() == b"d" and len(taken) == 3


@pytest.mark.trio
async def test_memory_pipe_close_breaks_the_other_side() -> None:
    left, right = memory_pipe(4)
    await right.aclose()
    with pytest.raises(anyio.BrokenResourceError):
        await left.send(b"x")
    with pytest.raises(anyio.ClosedResourceError):
        await right.receive()
    await left.send_eof()
    await left.aclose()
