"""The prefill worker's compute slot, on virtual time: it passes to the next job when the
compute ends, not when the KV is accepted, so a prompt computes while the last one's KV still
crosses; at most `max_streaming` finished jobs stream at once, so a congested link still holds
the queue back; a stalled or abandoned stream gives its room back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import msgspec
import pytest
import trio
import trio.testing

from mesh.mailbox import Mailbox
from mesh.node import Node
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec
from services.contract.errors import KVStalled
from services.contract.messages import CODEC_MESSAGES, KVAccepted, KVOpen, PrefillRequest
from services.model.config import family_config
from services.model.model import build_model
from services.paper.hardware import CostModel, Pacer
from services.worker.compute import InlineRunner, Pacing
from services.worker.prefill import PrefillConfig, PrefillWorker
from services.worker.prefix_store import PrefixStore
from tests.prompts import tokens

ADDRESSES = {"q": Address("q", 1), "d": Address("d", 2)}
BOUND_S = 3600.0  # any wait here is a few virtual seconds; this only bounds a broken test


def request(k: int, kv_stall: float = 0.0) -> PrefillRequest:
    return PrefillRequest(request_id=f"r{k}", prompt=tokens(300, k), decode_worker="d",
                          kv_stall=kv_stall)


@dataclass
class SlowLink:
    """A stand-in decode worker behind a link that delivers nothing until let through: each
    request's lane is read (its pieces are in the link) but accepted only once `let(id)`."""

    opened: dict[str, float] = field(default_factory=dict)  # request id -> lane opened at
    accepted: dict[str, float] = field(default_factory=dict)
    gates: dict[str, anyio.Event] = field(default_factory=dict)

    def gate(self, request_id: str) -> anyio.Event:
        return self.gates.setdefault(request_id, anyio.Event())

    def let(self, request_id: str) -> None:
        self.gate(request_id).set()

    def serve(self, node: Node) -> None:
        @node.accepts_stream(KVOpen)
        async def on_kv(opening: KVOpen, items: Mailbox[msgspec.Struct],
                        ctx: Context) -> KVAccepted:
            self.opened[opening.request_id] = anyio.current_time()
            count = 0
            async for _ in items:
                count += 1
            await self.gate(opening.request_id).wait()
            self.accepted[opening.request_id] = anyio.current_time()
            return KVAccepted(request_id=opening.request_id, lane=opening.lane, pieces=count,
                              bytes=0)


@asynccontextmanager
async def worker(max_streaming: int = 1) -> AsyncIterator[tuple[PrefillWorker, SlowLink]]:
    """A prefill worker q (compute inline, paced to the H20 profile slowed 20x: seconds of
    virtual time per prefill) streaming to a SlowLink d, on one memory network."""
    hub, codec = MemoryHub(), Codec(CODEC_MESSAGES)
    model = build_model(family_config("kimi-linear", "tiny"), seed=0)
    q, d = (Node(name, codec, MemoryTransport(hub), ADDRESSES) for name in ("q", "d"))
    prefill = PrefillWorker(model, PrefixStore("q", model.cfg.block_size), [q],
                            PrefillConfig(name="q", chunk_tokens=128,
                                          max_streaming=max_streaming),
                            pacing=Pacing(CostModel.load("h20"), Pacer(20.0)),
                            runner=InlineRunner())
    link = SlowLink()
    link.serve(d)
    async with q, d:
        await d.listen()
        yield prefill, link


async def until(condition: object, prefill: PrefillWorker) -> None:
    """Polls `condition()` on virtual time, checking the worker's integrity at each step."""
    assert callable(condition)
    with trio.fail_after(BOUND_S):
        while not condition():
            prefill.check_integrity()
            await trio.sleep(0.01)


@asynccontextmanager
async def prefilling(
    count: int, max_streaming: int = 1,
) -> AsyncIterator[tuple[PrefillWorker, SlowLink]]:
    """worker()'s prefill of r0, r1, ... started a virtual millisecond apart, so they queue in
    order; leaving the block waits for all of them."""
    async with worker(max_streaming) as (prefill, link), anyio.create_task_group() as group:
        for k in range(count):
            group.start_soon(prefill.prefill, request(k))
            await trio.sleep(0.001)
        yield prefill, link


@pytest.mark.trio
async def test_the_next_prefill_starts_before_the_last_ones_kv_is_accepted(
        autojump_clock: trio.testing.MockClock) -> None:
    async with prefilling(2) as (prefill, link):
        # r0's KV is held on the link; r1 computes anyway and opens its own lane.
        await until(lambda: "r1" in link.opened, prefill)
        assert "r0" not in link.accepted
        stats = prefill.statistics()
        assert (stats.streaming, stats.running, stats.queue_depth) == (1, 1, 0)
        link.let("r0")
        link.let("r1")
    assert link.opened["r1"] < link.accepted["r0"]
    prefill.check_integrity()
    assert (prefill.busy, prefill.statistics().jobs) == (0, 2)


@pytest.mark.trio
async def test_with_no_room_to_stream_the_slot_is_held_until_the_kv_is_accepted(
        autojump_clock: trio.testing.MockClock) -> None:
    """max_streaming=0, the old behaviour: the same two requests, one after the other."""
    async with prefilling(2, max_streaming=0) as (prefill, link):
        await until(lambda: "r0" in link.opened, prefill)
        await trio.sleep(60.0)  # far longer than a prefill takes here
        assert "r1" not in link.opened
        assert prefill.statistics().queue_depth == 1
        link.let("r0")
        link.let("r1")
    assert link.accepted["r0"] <= link.opened["r1"]


@pytest.mark.trio
async def test_a_third_job_waits_while_one_streams_and_one_has_no_room(
        autojump_clock: trio.testing.MockClock) -> None:
    async with prefilling(3) as (prefill, link):
        # r0 streams; r1's compute is done (its lane is open) but it has no room: it keeps
        # the slot, and r2 stays queued however long the link holds r0.
        await until(lambda: "r1" in link.opened, prefill)
        await trio.sleep(60.0)
        stats = prefill.statistics()
        assert (stats.streaming, stats.running, stats.queue_depth) == (1, 1, 1)
        assert "r2" not in link.opened
        link.let("r0")
        await until(lambda: "r2" in link.opened, prefill)
        assert "r1" not in link.accepted
        link.let("r1")
        link.let("r2")
    assert link.accepted["r0"] <= link.opened["r2"]
    assert (prefill.busy, prefill.statistics().jobs) == (0, 3)


@pytest.mark.trio
async def test_a_stalled_stream_fails_and_gives_its_room_back(
        autojump_clock: trio.testing.MockClock) -> None:
    async with worker() as (prefill, link):
        with pytest.raises(KVStalled):
            await prefill.prefill(request(0, kv_stall=5.0))
        assert (prefill.busy, prefill.statistics().failures) == (0, 1)
        prefill.check_integrity()
        # The room and the slot are free: the next job streams and is accepted.
        link.let("r1")
        with trio.fail_after(BOUND_S):
            done = await prefill.prefill(request(1))
    assert done.request_id == "r1" and prefill.statistics().jobs == 1


@pytest.mark.trio
async def test_an_abandoned_stream_gives_its_room_back(
        autojump_clock: trio.testing.MockClock) -> None:
    async with worker() as (prefill, link):
        async with anyio.create_task_group() as group:
            group.start_soon(prefill.prefill, request(0))
            await until(lambda: prefill.statistics().streaming == 1, prefill)
            group.cancel_scope.cancel()  # its caller gives up while the KV crosses
        assert (prefill.busy, prefill.statistics().cancelled) == (0, 1)
        prefill.check_integrity()
        link.let("r1")
        with trio.fail_after(BOUND_S):
            await prefill.prefill(request(1))
    assert prefill.statistics().jobs == 1
