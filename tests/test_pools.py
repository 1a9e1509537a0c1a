"""Handler pools (mesh.pools) and abandoned calls: waiting requests never starve the requests
they wait for, and a call its caller cancels stops its handler at the callee."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from functools import partial

import anyio
import msgspec
import pytest
import trio
import trio.testing

from mesh.errors import ConfigError
from mesh.mailbox import Mailbox
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec


class Wait(msgspec.Struct, frozen=True, tag=True):
    key: int


class Put(msgspec.Struct, frozen=True, tag=True):
    key: int


class Done(msgspec.Struct, frozen=True, tag=True):
    key: int


class Slow(msgspec.Struct, frozen=True, tag=True):
    seconds: float


CODEC = Codec([Wait, Put, Done, Slow])
PEERS = {"server": Address("server", 1)}
SLOTS = 4


def rendezvous_node(transport: MemoryTransport, upload_slots: int | None) -> Node:
    """Streams that wait for an upload of their key, and uploads that deliver it."""
    node = Node("server", CODEC, transport, PEERS, NodeConfig(max_concurrency=SLOTS))
    arrived: dict[int, anyio.Event] = {}

    @node.serves_stream(Wait)
    async def on_wait(msg: Wait, ctx: Context) -> AsyncGenerator[msgspec.Struct, None]:
        await arrived.setdefault(msg.key, anyio.Event()).wait()
        yield Done(msg.key)

    @node.accepts_stream(Put, slots=upload_slots)
    async def on_put(msg: Put, items: Mailbox[msgspec.Struct], ctx: Context) -> Done:
        async for _ in items:
            pass
        arrived.setdefault(msg.key, anyio.Event()).set()
        return Done(msg.key)

    return node


async def wait_then_put(client: Node, key: int, done: list[int]) -> None:
    async with anyio.create_task_group() as group:
        async def read() -> None:
            async with client.open_stream("server", Wait(key), timeout=60) as items:
                async for item in items:
                    assert isinstance(item, Done)
                    done.append(item.key)

        group.start_soon(read)
        await anyio.sleep(0.01)  # every stream is open (and waiting) before any upload
        async with client.stream_to("server", Put(key), timeout=60) as sink:
            await sink.send(Put(key))


@pytest.mark.trio
async def test_uploads_in_their_own_pool_are_not_starved_by_the_streams_waiting_for_them(
        autojump_clock: trio.testing.MockClock) -> None:
    transport = MemoryTransport(MemoryHub())
    server = rendezvous_node(transport, upload_slots=2)
    client = Node("client", CODEC, transport, PEERS)
    done: list[int] = []
    async with server, client:
        await server.listen()
        # Twice as many waiting streams as the shared slots: they fill them all.
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for key in range(2 * SLOTS):
                    group.start_soon(wait_then_put, client, key, done)
        stats = server.statistics()
        server.check_integrity()
    assert sorted(done) == list(range(2 * SLOTS))
    [uploads] = stats.pools
    assert (uploads.name, uploads.handlers.capacity) == ("Put", 2)
    assert uploads.mailbox.put == 2 * SLOTS and stats.handlers.high_water == SLOTS


@pytest.mark.trio
async def test_without_a_pool_of_their_own_the_uploads_starve(
        autojump_clock: trio.testing.MockClock) -> None:
    # The deadlock the pools remove: every shared slot holds a stream waiting for an upload
    # that queues behind them.
    transport = MemoryTransport(MemoryHub())
    server = rendezvous_node(transport, upload_slots=None)
    client = Node("client", CODEC, transport, PEERS)
    done: list[int] = []
    async with server, client:
        await server.listen()
        with anyio.move_on_after(30) as scope, anyio.CancelScope():
            async with anyio.create_task_group() as group:
                for key in range(2 * SLOTS):
                    group.start_soon(wait_then_put, client, key, done)
    assert scope.cancelled_caught and len(done) < 2 * SLOTS


def test_a_pool_needs_a_slot() -> None:
    node = Node("server", CODEC, MemoryTransport(MemoryHub()), PEERS)
    with pytest.raises(ConfigError, match="slots for Put"):
        node.accepts_stream(Put, slots=0)


@pytest.mark.trio
async def test_a_cancelled_call_aborts_its_handler_at_the_callee(
        autojump_clock: trio.testing.MockClock) -> None:
    transport = MemoryTransport(MemoryHub())
    server = Node("server", CODEC, transport, PEERS)
    client = Node("client", CODEC, transport, PEERS)
    running, stopped = anyio.Event(), anyio.Event()

    @server.handles(Slow, slots=1)
    async def on_slow(msg: Slow, ctx: Context) -> Done:
        running.set()
        try:
            await anyio.sleep(msg.seconds)
        finally:
            stopped.set()
        return Done(0)

    async with server, client:
        await server.listen()
        async with anyio.create_task_group() as group:
            group.start_soon(partial(client.call, "server", Slow(3600.0), Done, timeout=7200.0))
            await running.wait()
            group.cancel_scope.cancel()
        with anyio.fail_after(1):
            await stopped.wait()
        # The pool's slot is free again at once, not after the hour.
        assert server.statistics().pools[0].handlers.busy == 0
        assert server.statistics().deadlines_in == 0


@pytest.mark.trio
async def test_worker_tasks_start_as_requests_arrive_up_to_the_slots(
        autojump_clock: trio.testing.MockClock) -> None:
    """A pool starts no worker until requests queue, one per request no idle worker takes,
    and never more than its slots; finished workers serve the next requests."""
    hub = MemoryHub()
    server = Node("server", CODEC, MemoryTransport(hub), PEERS, NodeConfig(max_concurrency=1))

    @server.serves_stream(Slow, slots=3)
    async def on_slow(msg: Slow, ctx: Context) -> AsyncGenerator[msgspec.Struct, None]:
        await anyio.sleep(msg.seconds)
        yield Done(0)

    client = Node("client", CODEC, MemoryTransport(hub), PEERS)

    async def slow(seconds: float) -> None:
        async with client.open_stream("server", Slow(seconds), timeout=60) as items:
            assert [item async for item in items] == [Done(0)]

    async with server, client:
        await server.listen()
        pool = server.pool_for(Slow)
        assert (pool.workers, server.pool_for(Done).workers) == (0, 0)
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(slow, 1.0)
        assert pool.workers == 2  # two at once: two workers
        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(slow, 1.0)
            await anyio.sleep(0.5)
            assert pool.slots.statistics().busy == 3 and pool.mailbox.depth == 2
        assert pool.workers == 3
        server.check_integrity()
