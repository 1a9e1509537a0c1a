"""Layer-wise prefill/transfer overlap on virtual time (issue 4's acceptance, made exact).

A real prefill worker (tiny kimi-linear, compute paced to the H200 profile, `InlineRunner`: the
compute takes no virtual time, only the pacing does) streams its KV over two lanes through the
real link emulator (netem's `LinkProxy` pump and `LinkShaper`, on in-memory channels) into a
decode worker's `KVInbox`. With the link set so that moving the KV takes as long as computing
it, streaming while computing must finish at most 0.55x of compute-then-transfer, and exactly
where the model of the tail says: only the fixed-size states and the last chunk are left for
after the compute.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.abc
import msgspec
import pytest
import torch
import trio

from mesh.mailbox import Mailbox
from mesh.node import Node
from mesh.server import Context
from mesh.transport import (
    Address,
    BoundListener,
    MemoryByteStream,
    MemoryHub,
    MemoryTransport,
    memory_pipe,
)
from mesh.wire import Codec
from netem.params import LinkParams
from netem.proxy import LinkProxy, ProxyConfig, Route
from netem.shaper import LinkShaper
from services.contract.messages import (
    CODEC_MESSAGES,
    KVAccepted,
    KVOpen,
    PrefillDone,
    PrefillRequest,
)
from services.model.cache import dtype_name
from services.model.config import family_config, kv_layout
from services.model.generate import prefill
from services.model.model import HybridLM, build_model
from services.paper.hardware import CostModel, Pacer
from services.worker.compute import ComputeRunner, InlineRunner, Pacing
from services.worker.engine import import_pieces
from services.worker.kv_in import KVInbox
from services.worker.kv_out import chunk_bounds, step_ends
from services.worker.prefill import PrefillConfig, PrefillWorker
from services.worker.prefix_store import PrefixStore

LENGTH = 4096
CHUNK = 64
DECODE = Address("127.0.0.1", 2)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return build_model(family_config("kimi-linear", "tiny"), seed=0)


def tokens(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 131) % 500 + 1 for i in range(n)]


class PipeChannel:
    """An in-memory pipe end as the proxy's ByteChannel (copies: the proxy reuses buffers)."""

    def __init__(self, stream: MemoryByteStream) -> None:
        self._stream = stream

    async def receive_into(self, buffer: memoryview) -> int:
        try:
            data = await self._stream.receive(len(buffer))
        except anyio.EndOfStream:
            return 0
        buffer[: len(data)] = data
        return len(data)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send(bytes(data))

    async def send_eof(self) -> None:
        await self._stream.send_eof()


@dataclass(frozen=True)
class LinkedTransport:
    """Connections through the emulated link: each one pumped by `proxy` in `group`."""

    hub: MemoryHub
    proxy: LinkProxy
    group: anyio.abc.TaskGroup

    async def connect(self, address: Address) -> anyio.abc.ByteStream:
        ours, link_end = memory_pipe(self.hub.buffer_chunks)
        upstream = await self.hub.connect(address)
        self.group.start_soon(self.proxy.pump_connection, PipeChannel(link_end),
                              PipeChannel(upstream))
        return ours

    async def listen(self, address: Address) -> BoundListener:
        raise NotImplementedError("the prefill side only dials")


Arrival = tuple[str, int, float]  # request, layer (-1: the close), virtual time


@asynccontextmanager
async def datapath(model: HybridLM, arrivals: list[Arrival], pacing: Pacing | None = None,
                   runner: ComputeRunner | None = None,
                   ) -> AsyncIterator[tuple[PrefillWorker, KVInbox, LinkShaper]]:
    """Prefill worker -> link -> decode inbox, on one memory network; arrivals noted."""
    hub, codec = MemoryHub(), Codec(CODEC_MESSAGES)
    shaper = LinkShaper(LinkParams(delay_s=0.001), anyio.current_time, random.Random(0))
    proxy = LinkProxy([Route(0, 0)], shaper, ProxyConfig(chunk_bytes=4096))
    cfg = model.cfg
    inbox = KVInbox("d", (cfg.family, cfg.config_hash(), dtype_name(model.dtype)), 60.0)
    decode = Node("d", codec, MemoryTransport(hub), {"d": DECODE})

    @decode.accepts_stream(KVOpen)
    async def on_kv(opening: KVOpen, items: Mailbox[msgspec.Struct], ctx: Context) -> KVAccepted:
        async def noted() -> AsyncIterator[msgspec.Struct]:
            async for item in items:
                arrivals.append((opening.request_id, getattr(item, "layer", -1),
                                 anyio.current_time()))
                yield item

        return await inbox.receive(opening, noted(), ctx.peer)

    async with anyio.create_task_group() as pumps, decode:
        await decode.listen(DECODE)
        transport = LinkedTransport(hub, proxy, pumps)
        lanes = [Node(f"p#{k}", codec, transport, {"d": DECODE}) for k in range(2)]
        async with lanes[0], lanes[1]:
            pacing = pacing or Pacing(CostModel.load("h200"), Pacer(1.0))
            worker = PrefillWorker(model, PrefixStore("p", cfg.block_size), lanes,
                                   PrefillConfig(name="p", chunk_tokens=CHUNK), pacing=pacing,
                                   runner=runner or InlineRunner())
            yield worker, inbox, shaper
        pumps.cancel_scope.cancel()


async def run(worker: PrefillWorker, salt: int, **change: object) -> PrefillDone:
    request = PrefillRequest(request_id=f"r{salt}", prompt=tokens(LENGTH, salt),
                             decode_worker="d", connections=2)
    return await worker.prefill(msgspec.structs.replace(request, **change))


def test_step_ends_follow_the_modeled_cost_of_each_chunk() -> None:
    cost = CostModel.load("h200")
    chunks = chunk_bounds(64, 1000, 256)  # (64, 256), (256, 512), (512, 768), (768, 1000)
    ends = step_ends(chunks, 4, cost.prefill_time)
    assert len(ends) == 16 and ends == sorted(ends) and ends[0] > 0
    assert ends[-1] == pytest.approx(cost.prefill_time(1000 - 64, 64))
    per_chunk = [ends[i + 3] - (ends[i - 1] if i else 0.0) for i in range(0, 16, 4)]
    # The short first chunk costs less; later chunks attend to longer prefixes and cost more.
    assert per_chunk[0] < per_chunk[1] < per_chunk[2]
    assert per_chunk[0] == pytest.approx(per_chunk[1] * 192 / 256, rel=0.01)
    # Layers of a chunk share its time evenly.
    assert ends[5] - ends[4] == pytest.approx(ends[6] - ends[5])


@pytest.mark.trio
async def test_streaming_while_computing_hides_the_transfer(
    model: HybridLM, autojump_clock: trio.testing.MockClock
) -> None:
    async with datapath(model, []) as (worker, inbox, shaper):
        modeled = CostModel.load("h200").prefill_time(LENGTH)
        probe = await run(worker, 1)  # unshaped: how many bytes
        shaper.set_params(LinkParams(bandwidth_bps=probe.kv_bytes * 8 / modeled, delay_s=0.001))
        held = await run(worker, 2, overlap=False)
        streamed = await run(worker, 3)
        layer_wise = await run(worker, 4, chunk_tokens=0)
        pieces = inbox.claim("r3").pieces
        worker.check_integrity()
    # The baseline: compute alone, then the same KV through the link alone, about as long.
    assert held.compute_s == pytest.approx(modeled, rel=1e-6)
    assert 0.97 < held.transfer_s / held.compute_s < 1.06
    serial = held.compute_s + held.transfer_s
    assert streamed.compute_s == pytest.approx(modeled, rel=1e-6)
    ratio = streamed.total_s / serial
    layout = kv_layout(model.cfg, "float32")
    state = layout.fixed / (layout.fixed + layout.per_token * LENGTH)
    tail = state + (1 - state) * CHUNK / LENGTH  # what is left once the compute ends
    assert ratio <= 0.55
    assert ratio == pytest.approx((1 + tail) / 2, abs=0.01)
    # One chunk: tiny's only full-attention layer is its last, so nothing can overlap.
    assert layer_wise.total_s / serial > 0.95
    # What went over the link is the prompt's cache.
    rebuilt = import_pieces(model.cfg, "float32", None, pieces)
    reference = prefill(model, tokens(LENGTH, 3)).cache
    assert rebuilt.length == reference.length == LENGTH
    for got, want in zip(rebuilt.layers, reference.layers, strict=True):
        for name in ("state", "conv_tail", "buffers"):
            x, y = getattr(got, name, None), getattr(want, name, None)
            if isinstance(x, list) and isinstance(y, list):
                x, y = [t[:, :LENGTH] for t in x], [t[:, :LENGTH] for t in y]
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)


@pytest.mark.trio
async def test_pieces_leave_when_their_modeled_layer_ends(
    model: HybridLM, autojump_clock: trio.testing.MockClock
) -> None:
    arrivals: list[Arrival] = []
    async with datapath(model, arrivals) as (worker, _, _):
        start = anyio.current_time()
        done = await run(worker, 5, chunk_tokens=0)
    ends = step_ends([(0, LENGTH)], 4, CostModel.load("h200").prefill_time)
    by_layer = {layer: t - start for _, layer, t in arrivals if layer >= 0}
    # With no link bandwidth limit, each piece arrives just after its layer's modeled end.
    for layer in range(4):
        assert ends[layer] <= by_layer[layer] < ends[layer] + 0.01
    assert done.compute_s == pytest.approx(ends[-1])


class TaskedInlineRunner(InlineRunner):
    """An inline compute run as a thread's would be: in a task beside the release."""

    inline = False


@pytest.mark.trio
async def test_an_inline_compute_releases_as_a_compute_task_would(
    model: HybridLM, autojump_clock: trio.testing.MockClock
) -> None:
    """The inline runner's compute is done before its release (no task for it): the same
    pieces reach the decode side at the same times, and the same report comes back."""
    seen: list[tuple[list[Arrival], list[PrefillDone]]] = []
    for runner in (InlineRunner(), TaskedInlineRunner()):
        arrivals: list[Arrival] = []
        async with datapath(model, arrivals, runner=runner) as (worker, _, _):
            start = anyio.current_time()
            done = [await run(worker, 20), await run(worker, 21, overlap=False)]
        # Each run starts at its own virtual time: times since then, to the nanosecond.
        seen.append(([(r, layer, round(t - start, 9)) for r, layer, t in arrivals], done))
    (inline, inline_done), (tasked, tasked_done) = seen
    # Lanes sending at the same instant interleave as trio picks: compared as sets.
    assert len(inline) > 8 and sorted(inline) == sorted(tasked)
    assert [rounded(d) for d in inline_done] == [rounded(d) for d in tasked_done]


def rounded(done: PrefillDone) -> dict[str, object]:
    """A report with its times to the nanosecond (each run starts at its own virtual time)."""
    fields = msgspec.structs.asdict(done)
    return {k: round(v, 9) if isinstance(v, float) else v for k, v in fields.items()}


@pytest.mark.trio
@pytest.mark.parametrize("profile", ["h200", "h20"])
async def test_emulation_paces_at_the_modeled_length(
    model: HybridLM, autojump_clock: trio.testing.MockClock, profile: str
) -> None:
    """At the demo's scale (a served token stands for 32), a 32x longer request takes what
    the profile says a 32x longer request takes, on either hardware."""
    cost = CostModel.load(profile)
    pacing = Pacing(cost, Pacer(1.0), tokens_per_served=32)
    short, long = 64, 64 * 32
    async with datapath(model, [], pacing) as (worker, _, _):
        quick = await run(worker, 11, prompt=tokens(short, 11), chunk_tokens=0)
        slow = await run(worker, 12, prompt=tokens(long, 12), chunk_tokens=0)
    expected = cost.prefill_time(long * 32) / cost.prefill_time(short * 32)
    assert expected > 5
    assert slow.compute_s / quick.compute_s == pytest.approx(expected, rel=0.10)
