"""netem.memory: the link on an in-memory network shapes whole mesh frames by their weight."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest

from mesh.transport import Address, MemoryHub
from mesh.wire import HEADER_SIZE
from netem.memory import MemoryLink, MemoryRoute, frames, frames_of
from netem.params import LinkParams
from netem.shaper import LinkShaper

LISTEN, UPSTREAM = Address("sim", 1), Address("sim", 2)


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(HEADER_SIZE, "big") + body


def test_frames_are_cut_whole_and_the_rest_stays() -> None:
    buffer = bytearray(frame(b"ab") + frame(b"") + frame(b"xyz")[:5])
    assert frames(buffer) == [frame(b"ab"), frame(b"")]
    assert bytes(buffer) == frame(b"xyz")[:5]
    buffer += frame(b"xyz")[5:]
    assert frames(buffer) == [frame(b"xyz")] and not buffer


def test_frames_of_a_chunk_are_the_reference_cut_on_any_split() -> None:
    stream = frame(b"ab") + frame(b"") + frame(b"xyz" * 7) + frame(b"q")
    for cut in ([len(frame(b"ab"))], [1, 3, 9], list(range(1, len(stream))), []):
        fast, slow = bytearray(), bytearray()
        got: list[bytes] = []
        expected: list[bytes] = []
        for start, end in zip([0, *cut], [*cut, len(stream)], strict=True):
            chunk = stream[start:end]
            got += [bytes(f) for f in frames_of(fast, chunk)]
            slow += chunk
            expected += frames(slow)
        assert got == expected == [frame(b"ab"), frame(b""), frame(b"xyz" * 7), frame(b"q")]
        assert not fast and not slow
    # A body that looks like a whole frame is not one while a header lies buffered.
    tricky = frame(frame(b"Z"))
    buffer = bytearray()
    assert frames_of(buffer, tricky[:HEADER_SIZE]) == []
    assert frames_of(buffer, tricky[HEADER_SIZE:]) == [tricky] and not buffer
    # A chunk that is one whole frame, with nothing buffered, is passed on as it is.
    whole = frame(b"kv")
    assert frames_of(bytearray(), whole)[0] is whole


async def _echo_server(hub: MemoryHub, received: list[tuple[float, bytes]]) -> None:
    listener = hub.register(UPSTREAM)
    async with listener:
        async for stream in listener._backlog:
            async with stream:
                while True:
                    try:
                        chunk = await stream.receive()
                        received.append((anyio.current_time(), chunk))
                    except anyio.EndOfStream:
                        return


@asynccontextmanager
async def running(hub: MemoryHub, link: MemoryLink, received: list[tuple[float, bytes]],
                  ) -> AsyncIterator[tuple[anyio.abc.ByteStream, float]]:
    """The link running between a client at LISTEN and a server at UPSTREAM that notes when
    each chunk arrives in `received`; yields the client and the time it connected."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_echo_server, hub, received)
        await tg.start(link.run)
        start = anyio.current_time()
        async with await hub.connect(LISTEN) as client:
            yield client, start
        tg.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_weighted_frame_takes_its_weight_in_wire_time(autojump_clock: object) -> None:
    """100 MB declared in a 10-byte frame at 1 Gbps + 20 ms arrives after 0.82 s."""
    hub = MemoryHub()
    shaper = LinkShaper(LinkParams(bandwidth_bps=1e9, delay_s=0.02), anyio.current_time,
                        random.Random(0))
    declared = 100_000_000

    def weight(body: memoryview) -> int:
        return declared if bytes(body) == b"kv-piece!!" else len(body)

    link = MemoryLink(hub, [MemoryRoute(LISTEN, UPSTREAM)], shaper, weight)
    received: list[tuple[float, bytes]] = []
    async with running(hub, link, received) as (client, start):
        await client.send(frame(b"kv-piece!!") + frame(b"small"))
        await anyio.sleep(2)
    times = [t - start for t, _ in received]
    data = b"".join(chunk for _, chunk in received)
    assert data == frame(b"kv-piece!!") + frame(b"small")
    expected = (declared + HEADER_SIZE) * 8 / 1e9 + 0.02
    assert times[0] == pytest.approx(expected, rel=1e-6)
    assert link.statistics().link.egress.bytes_out == declared + 2 * HEADER_SIZE + 5


@pytest.mark.trio
async def test_a_congested_link_holds_its_sender_as_the_proxy_does(
        autojump_clock: object) -> None:
    """Frames of 1 MB at 8 Mbps (1 s of wire each): the reader takes a frame only while at
    most the proxy's queue (1 MiB, about 1 s here) lies ahead of the last one's end, so a
    sender of 40 frames is held; only the pipe's few chunks and that queue are ever ahead."""
    hub = MemoryHub(buffer_chunks=2)
    shaper = LinkShaper(LinkParams(bandwidth_bps=8e6), anyio.current_time, random.Random(0))
    link = MemoryLink(hub, [MemoryRoute(LISTEN, UPSTREAM)], shaper,
                      lambda body: 1_000_000 if bytes(body) == b"kv" else len(body))
    sent: list[float] = []
    async with running(hub, link, []) as (client, start):
        for _ in range(40):
            await client.send(frame(b"kv"))
            sent.append(anyio.current_time() - start)
        backlog = shaper.statistics().egress.queued_bytes
    # Unbounded, all 40 would be taken at once; bounded, the sender keeps pace with the wire.
    assert sent[-1] > 30.0
    assert backlog <= 5 * 1_000_000


def _slow_link(hub: MemoryHub, size_of: Callable[[Any], int],
               **options: Any) -> tuple[LinkShaper, MemoryLink]:
    """An 8 Mbps, 10 ms link from LISTEN to UPSTREAM whose frames weigh `size_of(body)`."""
    shaper = LinkShaper(LinkParams(bandwidth_bps=8e6, delay_s=0.01), anyio.current_time,
                        random.Random(0))
    return shaper, MemoryLink(hub, [MemoryRoute(LISTEN, UPSTREAM)], shaper, size_of, **options)


@pytest.mark.trio
async def test_a_rate_change_re_times_the_frames_the_link_holds(autojump_clock: object) -> None:
    """A 1 MB frame at 8 Mbps (1 s of wire); at 0.5 s the rate doubles: the rest of it takes
    0.25 s, so it arrives at 0.75 s (plus the 10 ms delay), not at 1.01 s."""
    hub = MemoryHub()
    shaper, link = _slow_link(hub, lambda body: (
        1_000_000 - HEADER_SIZE if bytes(body) == b"kv" else len(body)))
    received: list[tuple[float, bytes]] = []
    async with running(hub, link, received) as (client, start):
        await client.send(frame(b"kv"))
        await anyio.sleep(0.5)
        shaper.set_params(LinkParams(bandwidth_bps=16e6, delay_s=0.01))
        await anyio.sleep(2)
    assert [t - start for t, _ in received] == [pytest.approx(0.76, rel=1e-9)]


async def _mixed_traffic(senders_admit: bool) -> tuple[list[float], list[tuple[float, bytes]]]:
    """Whole and split frames, large and small, bursts and pauses through a congested link
    (8 Mbps, a pipe of 2 chunks); when each send returned and when each chunk arrived."""
    hub = MemoryHub(buffer_chunks=2)
    _, link = _slow_link(hub, lambda body: 300_000 if bytes(body).startswith(b"kv") else len(body),
                         queue_bytes=500_000, senders_admit=senders_admit)
    sent: list[float] = []
    received: list[tuple[float, bytes]] = []
    async with running(hub, link, received) as (client, start):
        for index in range(60):
            body = b"kv%d" % index if index % 3 else b"small%d" % index
            if index % 7 == 0:
                whole = frame(body)
                await client.send(whole[:3])
                await client.send(whole[3:] + frame(b"tail"))
            else:
                await client.send(frame(body))
            sent.append(anyio.current_time() - start)
            if index % 5 == 0:
                await anyio.sleep(0.4 * (index % 3))
        await anyio.sleep(30)
    # Rounded: the two runs start at different instants of one clock.
    return [round(t, 9) for t in sent], [(round(t - start, 9), chunk) for t, chunk in received]


@pytest.mark.trio
async def test_frames_admitted_in_senders_tasks_move_as_the_readers_would(
        autojump_clock: object) -> None:
    """The sender-side admission (the fast path) against readers admitting every frame (the
    reference): each send returns, and each frame arrives, at the same instants."""
    fast = await _mixed_traffic(senders_admit=True)
    reference = await _mixed_traffic(senders_admit=False)
    assert fast == reference
    assert fast[0][-1] > 10.0  # the link held the sender: the backpressure was exercised
