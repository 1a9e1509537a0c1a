"""The calling side: deadlines on virtual time, download and upload streams, lost peers."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager, nullcontext

import anyio
import anyio.abc
import msgspec
import pytest
import trio
import trio.testing

from mesh.connection import Connection
from mesh.errors import DeadlineExceeded, PeerGone, RemoteError, StreamAborted
from mesh.mailbox import Mailbox
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport
from mesh.wire import Codec, Item
from tests.backends import backends_fixture


class Nap(msgspec.Struct, frozen=True, tag=True):
    seconds: float


class Count(msgspec.Struct, frozen=True, tag=True):
    n: int


class Stall(msgspec.Struct, frozen=True, tag=True):
    after: int


class Chunk(msgspec.Struct, frozen=True, tag=True):
    payload: bytes


class Upload(msgspec.Struct, frozen=True, tag=True):
    fail_after: int = -1


CODEC = Codec([Nap, Count, Stall, Chunk, Upload])
PEERS = {"srv": Address("srv", 1)}


async def logged(log: list[str]) -> None:
    """Returns once the server has logged what became of a stream (at most 5 s)."""
    with trio.fail_after(5):
        while not log:
            await trio.sleep(0.01)


def server(hub: MemoryHub, log: list[str]) -> Node:
    # A small send buffer keeps the endless stream below from queueing a million items.
    node = Node("srv", CODEC, MemoryTransport(hub), PEERS, NodeConfig(send_buffer=4096))

    @node.handles(Nap)
    async def on_nap(msg: Nap, ctx: Context) -> Count:
        try:
            await trio.sleep(msg.seconds)
        finally:
            log.append(f"nap ended at {trio.current_time():.1f}")
        return Count(0)

    @node.serves_stream(Count)
    async def count_to(msg: Count, ctx: Context) -> AsyncGenerator[Count, None]:
        try:
            for n in range(msg.n):
                yield Count(n)
        finally:
            log.append("count closed")

    @node.serves_stream(Stall)
    async def stall(msg: Stall, ctx: Context) -> AsyncGenerator[Count, None]:
        for n in range(msg.after):
            yield Count(n)
        if msg.after < 0:
            raise StreamAborted("negative count")
        await trio.sleep_forever()

    @node.accepts_stream(Upload)
    async def upload(first: Upload, items: Mailbox[msgspec.Struct], ctx: Context) -> Count:
        total = 0
        try:
            async for item in items:
                assert isinstance(item, Chunk)
                total += len(item.payload)
                if total > first.fail_after >= 0:
                    raise ValueError(f"refusing more than {first.fail_after} bytes")
        except StreamAborted as exc:
            log.append(f"upload aborted: {exc}")
            raise
        return Count(total)

    return node


def client(hub: MemoryHub) -> Node:
    return Node("cli", CODEC, MemoryTransport(hub), PEERS)


@asynccontextmanager
async def connected(hub: MemoryHub, log: list[str]) -> AsyncIterator[tuple[Node, Node]]:
    """The server (logging into `log`) listening on `hub`, and a client of it."""
    async with server(hub, log) as srv, client(hub) as cli:
        await srv.listen()
        yield srv, cli


@pytest.mark.trio
async def test_deadline_fires_on_virtual_time(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    log: list[str] = []
    wall = time.monotonic()
    async with connected(memory_hub, log) as (srv, cli):
        start = trio.current_time()
        with pytest.raises(DeadlineExceeded, match=r"call Nap to srv|srv: Nap handler") as err:
            await cli.call("srv", Nap(1000), timeout=5)
        assert trio.current_time() - start == pytest.approx(5)
        await trio.sleep(1)
        # The callee ran under the same deadline, so its handler was cancelled too.
        assert log == [f"nap ended at {start + 5:.1f}"]
        assert srv.statistics().deadlines_in == 1
        # Both deadlines fire at the same instant: the caller's own, and then the callee's
        # DeadlineExceeded comes late (a stray frame), or the callee's answer, handed to the
        # waiting call in the callee's task (the in-memory pipe's direct delivery), first.
        own = "call Nap to srv" in str(err.value)
        assert cli.statistics().deadlines_out == int(own)
        assert cli.statistics().stray_frames == int(own)
    assert time.monotonic() - wall < 30  # virtual seconds, not real ones


@pytest.mark.trio
async def test_download_stream_delivers_items_in_order(memory_hub: MemoryHub) -> None:
    log: list[str] = []
    async with connected(memory_hub, log) as (srv, cli):
        async with cli.open_stream("srv", Count(200)) as items:
            got = [item async for item in items]
        srv.check_integrity()
        cli.check_integrity()
    assert got == [Count(n) for n in range(200)]
    assert log == ["count closed"]


async def read_slowly(hub: MemoryHub, pauses: list[int]) -> tuple[list[Count], int, int]:
    """A download of 60 items through a stream buffer of one, read with the given pauses
    (virtual ms, cycled); (items, client stray frames, frames the client received)."""
    srv = server(hub, [])
    cli = Node("cli", CODEC, MemoryTransport(hub), PEERS, NodeConfig(stream_buffer=1))
    got: list[Count] = []
    async with srv, cli:
        await srv.listen()
        async with cli.open_stream("srv", Count(60)) as items:
            async for item in items:
                assert isinstance(item, Count)
                got.append(item)
                await trio.sleep(pauses[len(got) % len(pauses)] / 1000)
        cli.check_integrity()
        stats = cli.statistics()
    return got, stats.stray_frames, stats.frames_in


@pytest.mark.trio
@pytest.mark.parametrize("pauses", [[0], [0, 3, 0, 0, 7, 1], [5, 0], [2, 2, 0, 9, 0, 0, 0]])
async def test_download_items_handed_over_by_their_senders_match_the_reader_path(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch, pauses: list[int],
) -> None:
    """On the in-memory pipe a stream's items go into its buffer in the sending task while no
    reader holds a frame and there is room (ClientSession._offer); the rest queue behind the
    reader. A slow consumer behind a buffer of one still gets every item once, in order, as it
    does when every frame goes through the reader task (the reference: no `deliver_some`)."""
    fast = await read_slowly(memory_hub, pauses)
    with monkeypatch.context() as patch:
        patch.setattr(Connection, "deliver_some", lambda self, route: False)
        reference = await read_slowly(MemoryHub(), pauses)
    assert fast == reference
    assert fast[0] == [Count(n) for n in range(60)]


@pytest.mark.trio
async def test_an_answer_is_handed_over_only_while_no_reader_holds_a_frame(
    memory_hub: MemoryHub,
) -> None:
    """ClientSession._offer: a stream item goes straight into its buffer while no reader
    holds a frame and there is room; while one does, or the buffer is full, it is left to the
    reader, behind that frame; so is a frame for no one (the reader counts it as stray)."""
    cli = Node("cli", CODEC, MemoryTransport(memory_hub), PEERS, NodeConfig(stream_buffer=1))
    async with server(memory_hub, []) as srv, cli:
        await srv.listen()
        async with cli.open_stream("srv", Stall(0)) as items:
            await trio.testing.wait_all_tasks_blocked()
            (session,) = cli._peers.sessions()
            (id,) = session._waiters
            session._routing = True
            assert not session._offer(Item(id, Count(1)))
            session._routing = False
            assert not session._offer(Item(id + 1, Count(9)))
            assert session._offer(Item(id, Count(1)))
            assert not session._offer(Item(id, Count(2)))  # the buffer of one is full
            assert await items.__anext__() == Count(1)
            assert session.stray_frames == 0


@pytest.mark.trio
async def test_leaving_a_download_early_stops_the_server(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    log: list[str] = []
    async with connected(memory_hub, log) as (_srv, cli):
        async with cli.open_stream("srv", Count(10**9)) as items:
            async for item in items:
                if item == Count(2):
                    break
        await logged(log)
    assert log == ["count closed"]


@pytest.mark.trio
async def test_server_abort_reaches_the_reader(memory_hub: MemoryHub) -> None:
    async with connected(memory_hub, []) as (_srv, cli):
        with pytest.raises(StreamAborted, match="negative count"):
            async with cli.open_stream("srv", Stall(-1)) as items:
                async for _ in items:
                    pass


@pytest.mark.trio
async def test_upload_stream_returns_the_handlers_reply(memory_hub: MemoryHub) -> None:
    async with connected(memory_hub, []) as (srv, cli):
        async with cli.stream_to("srv", Upload()) as sink:
            for n in range(50):
                await sink.send(Chunk(b"x" * n))
        srv.check_integrity()
        cli.check_integrity()
        assert sink.result == Count(sum(range(50)))
        assert sink.sent == 50


@pytest.mark.trio
@pytest.mark.parametrize(("ending", "told"), [
    ("raises", "sender raised KeyError: 'oops'"),
    ("is cancelled", "the sender was cancelled before its end"),
])
async def test_a_sender_that_raises_or_is_cancelled_in_its_body_aborts_the_upload(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock, ending: str, told: str
) -> None:
    """Raising, or cancelled as its body ends (before End is out): the receiver is told, not
    left open, and the sender's exception (not the cancellation) reaches its caller."""
    log: list[str] = []
    escapes = pytest.raises(KeyError) if ending == "raises" else nullcontext()
    async with connected(memory_hub, log) as (srv, cli):
        with trio.CancelScope() as scope, escapes:
            async with cli.stream_to("srv", Upload()) as sink:
                await sink.send(Chunk(b"abc"))
                if ending == "raises":
                    raise KeyError("oops")
                scope.cancel()
        assert scope.cancelled_caught == (ending == "is cancelled")
        await logged(log)
        srv.check_integrity()
    assert log == [f"upload aborted: cli: {told}"]


@pytest.mark.trio
async def test_receiver_failure_stops_the_sender_early(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    async with connected(memory_hub, []) as (_srv, cli):
        sent = 0
        with pytest.raises(RemoteError, match="ValueError: refusing more than 10 bytes"):
            async with cli.stream_to("srv", Upload(fail_after=10)) as sink:
                for _ in range(1000):
                    await sink.send(Chunk(b"12345"))
                    sent += 1
                    await trio.sleep(0.001)
        assert 3 <= sent < 10


@asynccontextmanager
async def client_of_a_killable_server(
    hub: MemoryHub,
) -> AsyncIterator[tuple[Node, trio.CancelScope]]:
    """A client, and a serving server that cancelling the scope beside it kills alone."""
    scope = trio.CancelScope()

    async def run(task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await server(hub, []).serve(task_status=task_status)

    async with client(hub) as cli, trio.open_nursery() as nursery:
        await nursery.start(run)
        yield cli, scope


@pytest.mark.trio
async def test_peer_dying_mid_stream_is_an_error_before_the_deadline(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    async with client_of_a_killable_server(memory_hub) as (cli, kill):
        start = trio.current_time()
        got: list[msgspec.Struct] = []
        with pytest.raises(PeerGone):
            async with cli.open_stream("srv", Stall(3), timeout=100) as items:
                async for item in items:
                    got.append(item)
                    if len(got) == 3:
                        kill.cancel()  # the server process dies
        assert got == [Count(0), Count(1), Count(2)]
        assert trio.current_time() - start < 1


@pytest.mark.trio
async def test_hung_peer_mid_stream_hits_the_deadline(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    async with connected(memory_hub, []) as (_srv, cli):
        start = trio.current_time()
        got: list[msgspec.Struct] = []
        # Both ends' deadlines pass at the same instant: the reader's own fails the stream,
        # or the server's DeadlineExceeded, handed over in the server's task (the in-memory
        # pipe's ClientSession._offer), gets there first; either way at the deadline.
        with pytest.raises(DeadlineExceeded,
                           match=r"stream from srv|srv: Stall handler passed its deadline"):
            async with cli.open_stream("srv", Stall(2), timeout=10) as items:
                async for item in items:
                    got.append(item)
        assert got == [Count(0), Count(1)]
        assert trio.current_time() - start == pytest.approx(10)


@pytest.mark.trio
async def test_peer_dying_during_a_call_is_peer_gone(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    async with client_of_a_killable_server(memory_hub) as (cli, kill), \
            trio.open_nursery() as nursery:

        async def kill_soon() -> None:
            await trio.sleep(1)
            kill.cancel()

        nursery.start_soon(kill_soon)
        with pytest.raises(PeerGone):
            await cli.call("srv", Nap(1000), timeout=100)
        assert trio.current_time() == pytest.approx(1)


anyio_backend = backends_fixture()


def backend_neutral_server(node: Node) -> Node:
    """`node` answering Nap and serving Count with anyio's sleep: on trio or asyncio alike."""

    @node.handles(Nap)
    async def on_nap(msg: Nap, ctx: Context) -> Count:
        await anyio.sleep(msg.seconds)
        return Count(int(msg.seconds * 1000))

    @node.serves_stream(Count)
    async def count_to(msg: Count, ctx: Context) -> AsyncGenerator[Count, None]:
        for n in range(msg.n):
            yield Count(n)

    return node


def tcp_server(address: Address) -> Node:
    return backend_neutral_server(Node("srv", CODEC, TcpTransport(), {"srv": address}))


@pytest.mark.anyio
async def test_calls_beside_and_after_a_download_over_tcp() -> None:
    # On asyncio, answers skip the reader task only while no stream is open: this crosses
    # that line both ways with calls in flight.
    srv = tcp_server(Address("127.0.0.1", 0))
    async with srv:
        address = await srv.listen(Address("127.0.0.1", 0))
        async with Node("cli", CODEC, TcpTransport(), {"srv": address}) as cli:
            assert await cli.call("srv", Nap(0), timeout=10) == Count(0)
            # Fewer items than the stream buffer: unread ones must not hold up the answers.
            async with cli.open_stream("srv", Count(40), timeout=10) as items:
                got = [await items.__anext__()]
                async with anyio.create_task_group() as group:
                    for ms in (0, 1, 2):
                        group.start_soon(cli.call, "srv", Nap(ms / 1000), None)
                got += [item async for item in items]
            replies = [await cli.call("srv", Nap(0), timeout=10) for _ in range(20)]
            cli.check_integrity()
            assert cli.statistics().waiting_calls == 0
    assert got == [Count(n) for n in range(40)]
    assert replies == [Count(0)] * 20


@pytest.mark.anyio
async def test_calls_beside_a_slowly_read_download_in_memory() -> None:
    """On the in-memory pipe answers and items are handed over in the sending task (trio or
    asyncio alike): calls made while a download through a buffer of one is read slowly are
    answered, and the download still arrives whole and in order."""
    hub = MemoryHub()
    srv = backend_neutral_server(Node("srv", CODEC, MemoryTransport(hub), PEERS))
    cli = Node("cli", CODEC, MemoryTransport(hub), PEERS, NodeConfig(stream_buffer=1))
    replies: list[msgspec.Struct | None] = []

    async def call(seconds: float) -> None:
        replies.append(await cli.call("srv", Nap(seconds), timeout=10))

    async with srv, cli:
        await srv.listen()
        # The calls run beside the reader: an answer behind a stream item that waits for
        # room in the buffer waits with it (one connection, in order).
        async with cli.open_stream("srv", Count(50), timeout=10) as items, \
                anyio.create_task_group() as group:
            got: list[msgspec.Struct] = []
            async for item in items:
                got.append(item)
                if len(got) % 10 == 0:
                    group.start_soon(call, 0.001)
                await anyio.sleep(0)
        await call(0)
        cli.check_integrity()
        assert cli.statistics().stray_frames == 0
    assert got == [Count(n) for n in range(50)]
    assert replies == [Count(1)] * 5 + [Count(0)]


async def take_until(hub: MemoryHub, message: msgspec.Struct, stop: int | None,
                     raise_at: int | None, fast: bool) -> list[object]:
    """What a reader sees of a download when it stops taking at item `stop`, or `take`
    raises at `raise_at`: through take_each (fast), or by iterating (the reference)."""
    log: list[str] = []
    seen: list[object] = []

    def take(item: msgspec.Struct) -> bool:
        assert isinstance(item, Count)
        seen.append(item.n)
        if item.n == raise_at:
            raise KeyError(item.n)
        return item.n != stop

    async with connected(hub, log) as (srv, cli):
        try:
            async with cli.open_stream("srv", message) as items:
                if fast:
                    seen.append(("ended early", await items.take_each(take)))
                else:
                    stopped = False
                    async for item in items:
                        if not take(item):
                            stopped = True
                            break
                    seen.append(("ended early", stopped))
                seen.append(("finished", items.finished))
        except (KeyError, StreamAborted) as exc:
            seen.append(type(exc).__name__)
        if stop is not None or raise_at is not None:
            await logged(log)
        seen.append(log)
        srv.check_integrity()
        cli.check_integrity()
    return seen


@pytest.mark.trio
@pytest.mark.parametrize(("message", "stop", "raise_at"), [
    (Count(50), None, None), (Count(50), 0, None), (Count(50), 17, None), (Count(50), 49, None),
    (Count(10**9), 5, None), (Count(50), None, 3), (Count(0), None, None), (Stall(-1), None, None),
])
async def test_take_each_sees_a_download_as_iterating_it_does(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock,
    message: msgspec.Struct, stop: int | None, raise_at: int | None,
) -> None:
    """StreamReader.take_each hands items over in the delivering task; a reader stopping,
    raising, reaching the End or meeting the server's abort sees what `async for` sees."""
    fast = await take_until(memory_hub, message, stop, raise_at, fast=True)
    assert fast == await take_until(MemoryHub(), message, stop, raise_at, fast=False)
    if message == Count(50) and stop is None and raise_at is None:
        assert fast[:50] == list(range(50)) and fast[50:52] == [("ended early", False),
                                                               ("finished", True)]
