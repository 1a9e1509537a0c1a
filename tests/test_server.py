"""The serving side: failing handlers, bad frames and bad clients never stop the service."""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mesh.connection import Connection, client_handshake
from mesh.errors import FrameDecodeError, RemoteError
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport, Transport
from mesh.wire import HEADER_SIZE, Codec, Item, Open
from tests.backends import backends_fixture
from tests.ping import Ping, Pong


class Boom(msgspec.Struct, frozen=True, tag=True):
    text: str


class Stranger(msgspec.Struct, frozen=True, tag=True):
    pass


MAX_FRAME = 4096
CODEC = Codec([Ping, Pong, Boom], max_frame=MAX_FRAME)


def service(transport: Transport, address: Address) -> Node:
    node = Node("svc", CODEC, transport, {"svc": address})

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n)

    @node.handles(Boom)
    async def on_boom(msg: Boom, ctx: Context) -> msgspec.Struct | None:
        if msg.text == "reply with a stranger":
            return Stranger()
        raise ValueError(msg.text)

    return node


@pytest.mark.trio
async def test_failing_handler_answers_with_its_error_and_is_logged(
    memory_hub: MemoryHub, caplog: pytest.LogCaptureFixture
) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport, Address("svc", 1))
    async with svc, Node("cli", CODEC, transport, {"svc": Address("svc", 1)}) as cli:
        await svc.listen()
        with pytest.raises(RemoteError) as info:
            await cli.call("svc", Boom("bad input 3"))
        assert (info.value.peer, info.value.error, info.value.detail) == (
            "svc", "ValueError", "bad input 3")
        # A cast has nobody to answer: it is logged and counted, and the service goes on.
        await cli.cast("svc", Boom("cast went wrong"))
        assert await cli.call("svc", Ping(5)) == Pong(5)
        assert svc.statistics().handler_errors == 2
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert messages[0].startswith("handler for Boom from cli (id 1) failed")
    assert messages[1].startswith("handler for Boom from cli (id 0) failed")


@pytest.mark.trio
async def test_reply_outside_the_codec_fails_that_call_only(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport, Address("svc", 1))
    async with svc, Node("cli", CODEC, transport, {"svc": Address("svc", 1)}) as cli:
        await svc.listen()
        with pytest.raises(RemoteError, match="UnknownMessageType: Stranger"):
            await cli.call("svc", Boom("reply with a stranger"))
        assert await cli.call("svc", Ping(1)) == Pong(1)
        assert cli.statistics().connections_out == 1


@pytest.mark.trio
async def test_message_without_handler_fails_that_request(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    svc = service(transport, Address("svc", 1))
    async with svc, Node("cli", CODEC, transport, {"svc": Address("svc", 1)}) as cli:
        await svc.listen()
        with pytest.raises(RemoteError, match="LookupError: no Call handler for message type Pong"):
            await cli.call("svc", Pong(1))
        with pytest.raises(RemoteError, match="no Open handler for message type Ping"):
            async with cli.open_stream("svc", Ping(1)) as items:
                [item async for item in items]


async def send_raw_frame(transport: Transport, address: Address, frame: bytes) -> bool:
    """Handshakes properly, sends `frame`; True when the service then drops the connection."""
    stream = await transport.connect(address)
    conn = Connection(stream, CODEC)
    await client_handshake(conn, "rogue")
    await stream.send(frame)
    with anyio.move_on_after(5):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            await stream.aclose()
            return True
    await stream.aclose()
    return False


async def bad_frame_then_good_client(transport: Transport, frame: bytes) -> tuple[bool, int]:
    """Runs the service, sends it `frame` raw, then checks a proper client is still served."""
    svc = service(transport, Address("127.0.0.1", 0))
    async with svc:
        address = await svc.listen(Address("127.0.0.1", 0))
        dropped = await send_raw_frame(transport, address, frame)
        async with Node("cli", CODEC, transport, {"svc": address}) as cli:
            assert await cli.call("svc", Ping(7), timeout=10) == Pong(7)
        return dropped, svc.statistics().connection_errors


OVERSIZED = (MAX_FRAME + 1).to_bytes(HEADER_SIZE, "big") + b"\x00" * 64
GARBAGE = (3).to_bytes(HEADER_SIZE, "big") + b"\xc1\xc1\xc1"


@pytest.mark.parametrize("frame", [OVERSIZED, GARBAGE], ids=["oversized", "garbage"])
@pytest.mark.trio
async def test_bad_frame_drops_that_client_only_in_memory(
    memory_hub: MemoryHub, frame: bytes
) -> None:
    dropped, errors = await bad_frame_then_good_client(MemoryTransport(memory_hub), frame)
    assert dropped and errors == 1


anyio_backend = backends_fixture()


@pytest.mark.parametrize("frame", [OVERSIZED, GARBAGE], ids=["oversized", "garbage"])
@pytest.mark.anyio
async def test_bad_frame_drops_that_client_only_over_tcp(frame: bytes) -> None:
    dropped, errors = await bad_frame_then_good_client(TcpTransport(), frame)
    assert dropped and errors == 1


@given(body=st.binary(max_size=300), declared_extra=st.sampled_from([0, 0, 0, MAX_FRAME + 1]))
@settings(max_examples=40)
def test_random_frames_never_stop_the_service(body: bytes, declared_extra: int) -> None:
    frame = (len(body) + declared_extra).to_bytes(HEADER_SIZE, "big") + body
    decodes = declared_extra == 0 and _decodes(body)

    async def scenario() -> tuple[bool, int]:
        return await bad_frame_then_good_client(MemoryTransport(MemoryHub()), frame)

    clock = trio.testing.MockClock(autojump_threshold=0)
    dropped, errors = trio.run(scenario, clock=clock)
    # An undecodable or oversized frame costs its sender the connection; one that happens to
    # decode is an odd request that may or may not. Either way the next client was served
    # (asserted inside the scenario).
    if not decodes:
        assert (dropped, errors) == (True, 1)
    assert errors <= 1


def _decodes(body: bytes) -> bool:
    try:
        CODEC.decode(body)
    except FrameDecodeError:
        return False
    return True


class Slow(msgspec.Struct, frozen=True, tag=True):
    n: int


class Note(msgspec.Struct, frozen=True, tag=True):
    text: str


EAGER_CODEC = Codec([Ping, Pong, Slow, Note])


def eager_service(
    transport: Transport, log: list[str], release: trio.Event, config: NodeConfig | None = None
) -> Node:
    """`Ping` answers at once; `Slow` and `Note` suspend until `release` (or a 1 s nap)."""
    node = Node("svc", EAGER_CODEC, transport, {"svc": Address("svc", 1)}, config)
    running = [0]

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n)

    @node.handles(Slow)
    async def on_slow(msg: Slow, ctx: Context) -> Pong:
        running[0] += 1
        log.append(f"start {msg.n} ({running[0]} running)")
        try:
            if msg.n < 0:
                await release.wait()
            else:
                await trio.sleep(1)
        except trio.Cancelled:
            log.append(f"cancelled {msg.n}")
            raise
        finally:
            running[0] -= 1
        log.append(f"end {msg.n}")
        return Pong(msg.n)

    @node.handles(Note)
    async def on_note(msg: Note, ctx: Context) -> None:
        await release.wait()
        log.append(f"note {msg.text} done")

    return node


@pytest.mark.trio
async def test_a_suspended_handler_gets_its_own_task_and_blocks_nothing(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    transport = MemoryTransport(memory_hub)
    log: list[str] = []
    release = trio.Event()
    svc = eager_service(transport, log, release)
    peers = {"svc": Address("svc", 1)}
    async with svc, Node("cli", EAGER_CODEC, transport, peers) as cli:
        await svc.listen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cli.call, "svc", Slow(-1))
            await trio.testing.wait_all_tasks_blocked()
            # The slow call holds a task of its own; the connection reads on.
            assert await cli.call("svc", Ping(5)) == Pong(5)
            stats = svc.statistics()
            assert (stats.requests_eager, stats.requests_handed_off) == (2, 1)
            assert (stats.handlers.busy, stats.mailbox.put) == (1, 0)
            svc.check_integrity()
            release.set()
        assert log == ["start -1 (1 running)", "end -1"]
        assert svc.statistics().handlers.busy == 0


@pytest.mark.trio
async def test_a_client_leaving_cancels_its_calls_but_not_its_casts(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    transport = MemoryTransport(memory_hub)
    log: list[str] = []
    release = trio.Event()
    svc = eager_service(transport, log, release)
    async with svc:
        await svc.listen()
        async with Node("cli", EAGER_CODEC, transport, {"svc": Address("svc", 1)}) as cli:
            await cli.cast("svc", Note("kept"))
            with trio.move_on_after(0.5):
                await cli.call("svc", Slow(-2))
        # The client is gone: its call's handler was cancelled, its cast's runs on.
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["start -2 (1 running)", "cancelled -2"]
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "note kept done"
        svc.check_integrity()


@pytest.mark.parametrize("limit", [1, 2])
@pytest.mark.trio
async def test_max_concurrency_bounds_eager_and_queued_handlers_together(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock, limit: int
) -> None:
    transport = MemoryTransport(memory_hub)
    log: list[str] = []
    svc = eager_service(transport, log, trio.Event(), NodeConfig(max_concurrency=limit))
    peers = {"svc": Address("svc", 1)}
    async with svc, Node("a", EAGER_CODEC, transport, peers) as a:
        await svc.listen()
        async with Node("b", EAGER_CODEC, transport, peers) as b, trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon((a if n % 2 else b).call, "svc", Slow(n))
        svc.check_integrity()
        stats = svc.statistics()
    starts = [line for line in log if line.startswith("start")]
    assert len(starts) == 6
    assert max(int(line.split("(")[1][0]) for line in starts) == limit
    assert stats.handlers.high_water == limit
    if limit == 1:
        # One at a time: every start is followed by its own end.
        order = [line.split()[1] for line in starts]
        assert log == [line for n in order for line in (f"start {n} (1 running)", f"end {n}")]


def raw_frame(*fields: object) -> bytes:
    """A frame holding `fields` as an array envelope, whatever their values."""
    body = msgspec.msgpack.encode(list(fields))
    return len(body).to_bytes(HEADER_SIZE, "big") + body


PING = {"type": "Ping", "n": 1}
BAD_TIMEOUTS = [math.nan, math.inf, -1.0, 1e300]
WILD_FRAMES = [
    *(raw_frame(kind, 1, PING, timeout) for kind in ("open", "call") for timeout in BAD_TIMEOUTS),
    raw_frame("call", -1, PING, 1.0),
    raw_frame("call", 2**64 - 1, PING, 1.0),
    raw_frame("item", -5, PING),
    raw_frame("abort", 2**63, "x"),
]
WILD_IDS = [
    f"{kind}-{timeout}" for kind in ("open", "call") for timeout in BAD_TIMEOUTS
] + ["negative-id", "huge-id", "negative-item-id", "huge-abort-id"]


@pytest.mark.parametrize("frame", WILD_FRAMES, ids=WILD_IDS)
@pytest.mark.trio
async def test_out_of_range_fields_drop_that_client_only_in_memory(
    memory_hub: MemoryHub, frame: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    dropped, errors = await bad_frame_then_good_client(MemoryTransport(memory_hub), frame)
    assert dropped and errors == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    # Logged once, as a warning without a traceback.
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "dropping client rogue" in warnings[0].getMessage()


@pytest.mark.parametrize("frame", WILD_FRAMES[:8], ids=WILD_IDS[:8])
@pytest.mark.anyio
async def test_out_of_range_timeouts_drop_that_client_only_over_tcp(frame: bytes) -> None:
    dropped, errors = await bad_frame_then_good_client(TcpTransport(), frame)
    assert dropped and errors == 1


class Blob(msgspec.Struct, frozen=True, tag=True):
    payload: bytes


BLOB_CODEC = Codec([Ping, Pong, Blob])


def capped_service(transport: Transport, max_connections: int) -> Node:
    config = NodeConfig(max_connections=max_connections)
    node = Node("svc", BLOB_CODEC, transport, {}, config)

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        return Pong(msg.n)

    @node.handles(Blob)
    async def on_blob(msg: Blob, ctx: Context) -> Pong:
        return Pong(len(msg.payload))

    return node


@pytest.mark.anyio
async def test_a_large_frame_leaves_no_large_receive_buffer_behind() -> None:
    transport = TcpTransport()
    async with capped_service(transport, max_connections=4) as svc:
        address = await svc.listen(Address("127.0.0.1", 0))
        async with Node("cli", BLOB_CODEC, transport, {"svc": address}) as cli:
            size = 5 << 19
            assert await cli.call("svc", Blob(b"\x07" * size), timeout=10) == Pong(size)
            assert await cli.call("svc", Ping(1), timeout=10) == Pong(1)
            (link,) = svc.statistics().connections
            assert link.bytes_in > size and link.receive_buffer == 0


def _squash(value: Any) -> Any:
    """`value` with ints MessagePack cannot hold (beyond 64 bits) sent as floats instead."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, list):
        return [_squash(item) for item in value]
    if isinstance(value, dict):
        return {key: _squash(item) for key, item in value.items()}
    return value


WILD = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8,
)
BODIES = st.fixed_dictionaries({"type": st.sampled_from(["Ping", "Boom", "Nope"]), "n": WILD})
TAGS = ["hello", "proof", "call", "cast", "reply", "fail", "open", "push", "item", "end", "abort"]
ENVELOPES = st.builds(
    lambda tag, fields: raw_frame(*_squash([tag, *fields])),
    st.sampled_from([*TAGS, "bogus"]),
    st.lists(WILD | BODIES | st.just(PING), max_size=4),
)
EDGY_IDS = st.sampled_from([-1, 0, 2**63, 2**64 - 1, 2**70]) | st.integers()
EDGY_TIMEOUTS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300, None]) | st.floats()
# Well-formed requests whose id and timeout are the wild part: the shapes that reach handlers.
REQUESTS = st.builds(
    lambda tag, id, body, timeout: raw_frame(*_squash([tag, id, body, timeout])),
    st.sampled_from(["call", "open", "push"]),
    EDGY_IDS,
    BODIES | st.just(PING),
    EDGY_TIMEOUTS,
)
JUNK = st.one_of(
    st.tuples(st.just(False), st.binary(max_size=200)),
    st.tuples(st.just(True), ENVELOPES),
    st.tuples(st.just(True), REQUESTS),
    st.tuples(st.just(True), st.binary(min_size=1, max_size=200).map(
        lambda b: len(b).to_bytes(HEADER_SIZE, "big") + b)),
)


async def throw_junk(address: Address, after_hello: bool, junk: bytes) -> None:
    stream = await TcpTransport().connect(address)
    try:
        if after_hello:
            await client_handshake(Connection(stream, CODEC), "fuzzer")
        await stream.send(junk)
        await stream.send_eof()
    except (anyio.BrokenResourceError, anyio.EndOfStream):
        pass  # The service hung up first: what it does with junk is its own business.
    finally:
        await stream.aclose()


@given(junk=JUNK)
@example(junk=(True, raw_frame("open", 1, PING, math.nan)))
@example(junk=(True, raw_frame("push", 2, PING, math.nan)))
@settings(max_examples=120)
def test_random_bytes_and_wild_envelopes_over_tcp_never_stop_the_service(
    junk: tuple[bool, bytes],
) -> None:
    async def scenario() -> None:
        svc = service(TcpTransport(), Address("127.0.0.1", 0))
        async with svc:
            address = await svc.listen(Address("127.0.0.1", 0))
            await throw_junk(address, *junk)
            with trio.fail_after(5):
                while svc.statistics().connections_in:
                    await trio.sleep(0.001)
            async with Node("cli", CODEC, TcpTransport(), {"svc": address}) as cli:
                assert await cli.call("svc", Ping(7), timeout=5) == Pong(7)
            svc.check_integrity()

    trio.run(scenario)


@pytest.mark.trio
async def test_upload_items_handed_over_by_their_senders_keep_their_order(
    memory_hub: MemoryHub, autojump_clock: trio.testing.MockClock
) -> None:
    """Items reach an upload in the sending task while no reader holds a frame and the upload
    has room (ServerSession._deliver_now); while a reader waits for room with an item, later
    items queue behind it, so a slow handler still sees every item once, in order."""
    address = Address("srv", 1)
    srv = Node("srv", CODEC, MemoryTransport(memory_hub), {"srv": address},
               NodeConfig(stream_buffer=1))
    seen: list[int] = []

    @srv.accepts_stream(Ping)
    async def collect(first: Ping, items: Any, ctx: Context) -> Pong:
        async for item in items:
            seen.append(item.n)
            await trio.sleep(0.01 * (item.n % 4))
        return Pong(len(seen))

    cli = Node("cli", CODEC, MemoryTransport(memory_hub), {"srv": address})
    async with srv, cli:
        await srv.listen()
        async with cli.stream_to("srv", Ping(-1)) as sink:
            for n in range(60):
                await sink.send(Ping(n))
                if n % 9 == 0:
                    await trio.sleep(0.05)
        srv.check_integrity()
    assert sink.result == Pong(60)
    assert seen == list(range(60))


@pytest.mark.trio
async def test_an_item_is_handed_over_only_while_no_reader_holds_a_frame(
    memory_hub: MemoryHub,
) -> None:
    """ServerSession._deliver_now: an upload's item goes straight in while no reader holds a
    frame; while one does, it is left to the reader, behind that frame."""
    address = Address("srv", 1)
    srv = Node("srv", CODEC, MemoryTransport(memory_hub), {"srv": address})
    seen: list[int] = []

    @srv.accepts_stream(Ping)
    async def collect(first: Ping, items: Any, ctx: Context) -> Pong:
        async for item in items:
            seen.append(item.n)
        return Pong(len(seen))

    cli = Node("cli", CODEC, MemoryTransport(memory_hub), {"srv": address})
    async with srv, cli:
        await srv.listen()
        async with cli.stream_to("srv", Ping(-1)) as sink:
            await sink.send(Ping(0))
            await trio.testing.wait_all_tasks_blocked()
            (session,) = srv._incoming.sessions
            (request,) = session._active.values()
            session._routing = True
            assert not session._deliver_now(Item(request.id, Ping(1)))
            session._routing = False
            assert session._deliver_now(Item(request.id, Ping(1)))
    assert seen == [0, 1] and sink.result == Pong(2)


@pytest.mark.trio
async def test_a_stream_is_opened_in_the_senders_task_only_while_its_pool_has_room(
    memory_hub: MemoryHub,
) -> None:
    """ServerSession._deliver_now on an Open: queued at once while the pool's mailbox has
    room; a full mailbox, or a reused id, is left to the reader (which waits, or raises)."""
    address = Address("srv", 1)
    srv = Node("srv", CODEC, MemoryTransport(memory_hub), {"srv": address},
               NodeConfig(mailbox_size=2))

    @srv.serves_stream(Ping, slots=1)
    async def nothing(msg: Ping, ctx: Context) -> Any:
        return
        yield

    cli = Node("cli", CODEC, MemoryTransport(memory_hub), {"srv": address})
    async with srv, cli:
        await srv.listen()
        async with cli.open_stream("srv", Ping(0)) as items:
            async for _ in items:
                pass
        (session,) = srv._incoming.sessions
        pool = srv.pool_for(Ping)
        assert session._deliver_now(Open(1000, Ping(1)))
        assert pool.mailbox.depth == 1 and 1000 in session._active
        assert not session._deliver_now(Open(1000, Ping(2)))  # id 1000 is open
        assert session._deliver_now(Open(1001, Ping(3)))
        assert not session._deliver_now(Open(1002, Ping(4)))  # the mailbox is full
        assert 1002 not in session._active and pool.mailbox.depth == 2
