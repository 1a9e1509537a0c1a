"""A node's accepted connections: the cap, the handshake's bounds, totals that never drop."""

from __future__ import annotations

import logging

import anyio
import pytest
import trio
import trio.testing

from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport, Transport
from mesh.wire import HEADER_SIZE, Codec
from tests.ping import Ping, Pong

CODEC = Codec([Ping, Pong])
# A frame whose body is not msgpack, sent where the client's Hello belongs.
GARBAGE = (3).to_bytes(HEADER_SIZE, "big") + b"\xc1\xc1\xc1"


def service(transport: Transport, config: NodeConfig | None = None) -> Node:
    node = Node("svc", CODEC, transport, {}, config)

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n)

    return node


async def refused_at_once(transport: Transport, address: Address) -> bool:
    """Connects raw; True when the service closes the stream without a word."""
    stream = await transport.connect(address)
    try:
        with anyio.fail_after(5):
            await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return True
    finally:
        await stream.aclose()
    return False


async def cap_scenario(transport: Transport, address: Address) -> None:
    svc = service(transport, NodeConfig(max_connections=2))
    async with svc:
        address = await svc.listen(address)
        peers = {"svc": address}
        async with Node("a", CODEC, transport, peers) as a:
            async with Node("b", CODEC, transport, peers) as b:
                assert await a.call("svc", Ping(1), timeout=10) == Pong(1)
                assert await b.call("svc", Ping(2), timeout=10) == Pong(2)
                assert await refused_at_once(transport, address)
                # The two admitted clients are served on as before.
                assert await a.call("svc", Ping(3), timeout=10) == Pong(3)
                assert await b.call("svc", Ping(4), timeout=10) == Pong(4)
                assert svc.statistics().connections_refused == 1
            # b left: its place is free again.
            with anyio.fail_after(5):
                while svc.statistics().connections_in > 1:
                    await anyio.sleep(0.01)
            async with Node("c", CODEC, transport, peers) as c:
                assert await c.call("svc", Ping(5), timeout=10) == Pong(5)
        assert svc.statistics().connections_refused == 1


@pytest.mark.trio
async def test_connections_over_the_cap_are_refused_in_memory(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    await cap_scenario(MemoryTransport(memory_hub), Address("svc", 1))
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert refusals == ["node svc refused a connection: max_connections=2 are open"]


@pytest.mark.anyio
async def test_connections_over_the_cap_are_refused_over_tcp() -> None:
    await cap_scenario(TcpTransport(), Address("127.0.0.1", 0))


@pytest.mark.trio
async def test_garbage_instead_of_hello_is_refused(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport)
    async with svc:
        address = await svc.listen(Address("svc", 1))
        stream = await transport.connect(address)
        await stream.send(GARBAGE)
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()
        await stream.aclose()
        assert svc.statistics().connection_errors == 1


@pytest.mark.trio
async def test_a_silent_connection_is_closed_at_the_handshake_timeout_and_frees_its_place(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport, NodeConfig(max_connections=1, handshake_timeout=3.0))
    async with svc:
        address = await svc.listen(Address("svc", 1))
        silent = await transport.connect(address)
        start = trio.current_time()
        with pytest.raises(anyio.EndOfStream):
            await silent.receive()
        assert trio.current_time() - start == pytest.approx(3.0)
        await silent.aclose()
        assert svc.statistics().connection_errors == 1
        # The one place it held is free: a real client is served.
        async with Node("cli", CODEC, transport, {"svc": address}) as cli:
            assert await cli.call("svc", Ping(1), timeout=10) == Pong(1)
        assert svc.statistics().connections_refused == 0


@pytest.mark.trio
async def test_a_closed_connection_keeps_its_traffic_in_the_totals(
    memory_hub: MemoryHub
) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport)
    async with svc:
        address = await svc.listen(Address("svc", 1))
        async with Node("cli", CODEC, transport, {"svc": address}) as cli:
            for n in range(5):
                assert await cli.call("svc", Ping(n), timeout=10) == Pong(n)
            served = svc.statistics()
        with anyio.fail_after(5):
            while svc.statistics().connections_in:
                await anyio.sleep(0.01)
        after = svc.statistics()
        assert served.frames_in >= 5 and served.bytes_in > 0
        assert (after.frames_in, after.frames_out) >= (served.frames_in, served.frames_out)
        assert (after.bytes_in, after.bytes_out) >= (served.bytes_in, served.bytes_out)
        assert after.connections == ()
