"""In-memory byte channels for driving `netem.proxy.LinkProxy` on virtual time in tests."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from netem.params import LinkParams
from netem.proxy import LinkProxy, ProxyConfig, Route
from netem.shaper import LinkShaper


class MemoryChannel:
    """One end of an in-memory duplex byte pipe, as the proxy's `ByteChannel`."""

    def __init__(
        self, send: MemoryObjectSendStream[bytes], receive: MemoryObjectReceiveStream[bytes]
    ) -> None:
        self._send = send
        self._receive = receive
        self._pending = memoryview(b"")

    async def receive_into(self, buffer: memoryview) -> int:
        if not self._pending:
            try:
                self._pending = memoryview(await self._receive.receive())
            except anyio.EndOfStream:
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    async def receive_all(self) -> tuple[bytes, float]:
        """Everything until end of stream, and the (virtual) time the last byte came."""
        parts, last = [], 0.0
        buffer = memoryview(bytearray(1 << 20))
        while count := await self.receive_into(buffer):
            parts.append(bytes(buffer[:count]))
            last = anyio.current_time()
        return b"".join(parts), last

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._send.send(bytes(data))

    async def send_eof(self) -> None:
        await self._send.aclose()


@asynccontextmanager
async def duplex() -> AsyncIterator[tuple[MemoryChannel, MemoryChannel]]:
    a_send, b_receive = anyio.create_memory_object_stream[bytes](16)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](16)
    async with a_send, b_receive, b_send, a_receive:
        yield MemoryChannel(a_send, a_receive), MemoryChannel(b_send, b_receive)


@asynccontextmanager
async def pumped(
    proxy: LinkProxy,
) -> AsyncIterator[tuple[MemoryChannel, MemoryChannel, trio.Nursery]]:
    """The proxy pumping between an app end and a server end; yields both and a nursery."""
    async with (
        duplex() as (app, client_end),
        duplex() as (upstream_end, server),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(proxy.pump_connection, client_end, upstream_end)
        yield app, server, nursery


async def send_then_eof(channel: MemoryChannel, payload: bytes, piece: int = 1 << 20) -> None:
    for offset in range(0, len(payload), piece):
        await channel.send_all(payload[offset : offset + piece])
    await channel.send_eof()


def proxied_link(
    params: LinkParams, seed: int = 1, config: ProxyConfig | None = None
) -> tuple[LinkShaper, LinkProxy]:
    """A shaper on trio's clock (the test's autojump clock) with seeded randomness, and a
    proxy of one route through it, for `pumped` to drive."""
    shaper = LinkShaper(params, trio.current_time, random.Random(seed))
    return shaper, LinkProxy([Route(0, 0)], shaper, config)
