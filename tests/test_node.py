"""Node: lifecycle, request/reply and casts over memory and TCP, statistics, backpressure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from mesh.errors import (
    ConfigError,
    DeadlineExceeded,
    HandshakeError,
    MeshError,
    PeerGone,
    UnexpectedReply,
    UnknownPeer,
)
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport, Transport
from mesh.wire import Codec
from tests.backends import backends_fixture
from tests.ping import Ping, Pong


class Note(msgspec.Struct, frozen=True, tag=True):
    text: str


class Hold(msgspec.Struct, frozen=True, tag=True):
    n: int


CODEC = Codec([Ping, Pong, Note, Hold])


def ping_node(name: str, transport: Transport, peers: dict[str, Address]) -> Node:
    node = Node(name, CODEC, transport, peers)
    notes: list[str] = []
    node.notes = notes  # type: ignore[attr-defined]

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n + 1)

    @node.handles(Note)
    async def on_note(msg: Note, ctx: Context) -> None:
        notes.append(f"{msg.text} from {ctx.peer}")

    return node


def b_in_memory(hub: MemoryHub, port: int = 1) -> tuple[MemoryTransport, dict[str, Address]]:
    """A transport on `hub` and the peer table that puts b at b:`port`."""
    return MemoryTransport(hub), {"b": Address("b", port)}


@asynccontextmanager
async def pinging(
    hub: MemoryHub, peers: dict[str, Address] | None = None
) -> AsyncIterator[tuple[Node, Node]]:
    """Nodes a and b open in memory, b a listening ping node; both know the peers `peers`
    names (b at b:1 when not given). Yields (a, b)."""
    transport, default_peers = b_in_memory(hub)
    known = default_peers if peers is None else peers
    async with ping_node("b", transport, known) as b, Node("a", CODEC, transport, known) as a:
        await b.listen()
        yield a, b


@pytest.mark.trio
async def test_call_and_cast_in_memory(autojump_clock: trio.testing.MockClock) -> None:
    transport = MemoryTransport(MemoryHub())
    peers: dict[str, Address] = {"b": Address("b", 1)}
    b = ping_node("b", transport, peers)
    a = Node("a", CODEC, transport, peers)
    async with b, a:
        await b.listen()
        assert await a.call("b", Ping(1), Pong) == Pong(2)
        assert await a.call("b", Note("no reply")) is None
        await a.cast("b", Note("hello"))
        with trio.fail_after(5):
            while len(b.notes) < 2:  # type: ignore[attr-defined]
                await trio.sleep(0.01)
    assert b.notes == ["no reply from a", "hello from a"]  # type: ignore[attr-defined]


anyio_backend = backends_fixture()


@pytest.mark.anyio
async def test_request_reply_over_tcp() -> None:
    peers: dict[str, Address] = {"b": Address("127.0.0.1", 0)}
    b = ping_node("b", TcpTransport(), peers)
    a = Node("a", CODEC, TcpTransport(), peers)
    async with b, a:
        peers["b"] = await b.listen()
        replies = [await a.call("b", Ping(n), Pong, timeout=10) for n in range(20)]
        await a.cast("b", Note("tcp"))
        assert await a.call("b", Ping(0), timeout=10) == Pong(1)
    assert replies == [Pong(n + 1) for n in range(20)]
    assert b.notes == ["tcp from a"]  # type: ignore[attr-defined]


@pytest.mark.trio
async def test_unexpected_reply_type_is_an_error(memory_hub: MemoryHub) -> None:
    async with pinging(memory_hub) as (a, _):
        with pytest.raises(UnexpectedReply, match="answered Ping with Pong, expected Note"):
            await a.call("b", Ping(1), Note)


@pytest.mark.trio
async def test_unknown_and_absent_peers(memory_hub: MemoryHub) -> None:
    async with Node("a", CODEC, MemoryTransport(memory_hub), {"b": Address("b", 1)}) as a:
        with pytest.raises(UnknownPeer, match="'zed'"):
            await a.call("zed", Ping(1))
        with pytest.raises(PeerGone, match="cannot connect to 'b'"):
            await a.call("b", Ping(1))


@pytest.mark.trio
async def test_dialled_peer_must_answer_with_its_name(memory_hub: MemoryHub) -> None:
    async with pinging(memory_hub, {"b": Address("b", 1), "c": Address("b", 1)}) as (a, _):
        with pytest.raises(HandshakeError, match="dialled 'c' at b:1 but 'b' answered"):
            await a.call("c", Ping(1))


@pytest.mark.trio
async def test_misuse_is_reported_clearly(memory_hub: MemoryHub) -> None:
    node = ping_node("b", MemoryTransport(memory_hub), {})
    with pytest.raises(MeshError, match="needs `async with node:`"):
        await node.call("x", Ping(1))
    with pytest.raises(ConfigError, match="Ping already has a handler"):
        node.handles(Ping)(lambda msg, ctx: None)  # type: ignore[arg-type,return-value]

    class Stranger(msgspec.Struct, tag=True):
        pass

    with pytest.raises(ConfigError, match="Stranger is not in the node's codec"):
        node.serves_stream(Stranger)(lambda msg, ctx: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="mailbox_size must be >= 1, got 0"):
        NodeConfig(mailbox_size=0)
    with pytest.raises(ConfigError, match="timeout must be >= 0 seconds, got -1"):
        async with node:
            await node.call("x", Ping(1), timeout=-1)


@pytest.mark.trio
async def test_exception_in_the_body_propagates_bare(memory_hub: MemoryHub) -> None:
    with pytest.raises(ValueError, match="mine"):
        async with Node("a", CODEC, MemoryTransport(memory_hub), {}):
            raise ValueError("mine")


@pytest.mark.trio
async def test_serve_reports_its_address_and_reconnects_after_restart(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    transport, peers = b_in_memory(memory_hub, port=7)
    async with Node("a", CODEC, transport, peers) as a:
        for generation in range(2):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(ping_node("b", transport, peers).serve)
                assert address == Address("b", 7)
                assert await a.call("b", Ping(generation), Pong) == Pong(generation + 1)
                nursery.cancel_scope.cancel()
            # The old connection is gone with its server; the next call redials.
            with pytest.raises(PeerGone):
                await a.call("b", Ping(0))
        assert a.statistics().connections_out == 0


@pytest.mark.trio
async def test_statistics_count_calls_frames_and_bytes(memory_hub: MemoryHub) -> None:
    async with pinging(memory_hub) as (a, b):
        for n in range(3):
            await a.call("b", Ping(n))
            a.check_integrity()
            b.check_integrity()
        await a.cast("b", Note("x"))
        await a.call("b", Ping(9))  # the cast is in when this answer is out
        out, into = a.statistics(), b.statistics()
    assert (out.calls_out, out.casts_out, out.connections_out) == (4, 1, 1)
    assert out.frames_out == 1 + 4 + 1  # Hello, calls, cast
    assert out.bytes_out == into.bytes_in > 0
    assert [c.peer for c in out.connections] == ["b"]
    assert (into.requests_in, into.connections_in) == (5, 1)
    # Quick handlers on an idle node run in the reader task: none of them queued.
    assert (into.requests_eager, into.requests_handed_off) == (5, 0)
    assert (into.mailbox.capacity, into.mailbox.put) == (256, 0)
    assert (into.handlers.capacity, into.handlers.busy, into.handlers.high_water) == (64, 0, 1)


@pytest.mark.trio
async def test_full_mailbox_pushes_back_to_the_sender(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    transport, peers = b_in_memory(memory_hub)
    config = NodeConfig(mailbox_size=2, max_concurrency=1)
    b = Node("b", CODEC, transport, peers, config)
    release = trio.Event()

    @b.handles(Hold)
    async def on_hold(msg: Hold, ctx: Context) -> None:
        await release.wait()

    async with b, Node("a", CODEC, transport, peers, NodeConfig(send_buffer=100)) as a:
        await b.listen()
        sent = 0
        with pytest.raises(DeadlineExceeded):
            for n in range(100_000):
                await a.cast("b", Hold(n), timeout=1.0)
                sent += 1
        a.check_integrity()
        b.check_integrity()
        stats = b.statistics().mailbox
        # One in the handler, two queued; the rest wait in the pipe, then at the sender.
        assert (stats.depth, stats.high_water) == (2, 2)
        assert 3 <= sent < 2000
        assert a.statistics().deadlines_out == 1
        release.set()
