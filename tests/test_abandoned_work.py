"""Abandoned work stops, on virtual time: a caller that gives up aborts its prefill (queued
ones leave the queue, the running one stops) and the decode worker lets go of the request's
KV at once; KV no decode stream asks for is dropped by the inbox's timer, with no other
transfer arriving to trigger it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
import pytest
import trio
import trio.testing

from mesh.errors import RemoteError, StreamAborted
from mesh.node import Node
from mesh.topology import parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec
from services.cli.launch import in_process
from services.cli.send import drive_request
from services.contract.messages import CODEC_MESSAGES, KVChunk, KVClose, KVOpen
from services.contract.sampling import Sampling
from services.model.config import family_config
from services.model.model import build_model
from services.paper.hardware import CostModel, Pacer
from services.worker.compute import InlineRunner, Pacing
from services.worker.decode import DecodeConfig, DecodeWorker
from services.worker.prefill import PrefillConfig, PrefillWorker
from services.worker.prefix_store import PrefixStore
from services.worker.service import WorkerService, serve_decode, serve_prefill
from tests.prompts import tokens
from tests.topologies import mesh_toml

ORPHAN_S = 8.0
ADDRESSES = {"q": Address("q", 1), "d": Address("d", 2)}
TOPOLOGY = mesh_toml(
    {"q": 1, "d": 2},
    worker='family = "kimi-linear", size = "tiny", checkpoint = "none", chunk_tokens = 128',
    options={"d": f"orphan_timeout = {ORPHAN_S}"})


@asynccontextmanager
async def datapath() -> AsyncIterator[tuple[Node, PrefillWorker, DecodeWorker]]:
    """A client, a prefill worker q (compute inline, paced to the H20 profile slowed 20x:
    seconds of virtual time per prefill) and a decode worker d, on one memory network."""
    hub, codec = MemoryHub(), Codec(CODEC_MESSAGES)
    model = build_model(family_config("kimi-linear", "tiny"), seed=0)
    cfg = model.cfg

    def node(name: str) -> Node:
        return Node(name, codec, MemoryTransport(hub), ADDRESSES)

    q, d, client = node("q"), node("d"), node("client")
    prefill = PrefillWorker(model, PrefixStore("q", cfg.block_size), [q],
                            PrefillConfig(name="q", chunk_tokens=128),
                            pacing=Pacing(CostModel.load("h20"), Pacer(20.0)),
                            runner=InlineRunner())
    decode = DecodeWorker(model, PrefixStore("d", cfg.block_size),
                          DecodeConfig(name="d", max_streams=8, orphan_timeout=ORPHAN_S))
    serve_prefill(q, prefill, slots=8)
    serve_decode(d, decode, upload_slots=4)
    async with q, d, client, anyio.create_task_group() as group:
        await q.listen()
        await d.listen()
        group.start_soon(decode.run)
        yield client, prefill, decode
        group.cancel_scope.cancel()


@pytest.mark.trio
async def test_callers_that_give_up_stop_their_prefills_and_free_their_kv(
        autojump_clock: trio.testing.MockClock) -> None:
    async with datapath() as (client, prefill, decode):
        async with anyio.create_task_group() as group:
            for k in range(3):
                group.start_soon(partial(
                    drive_request, client, tokens(600, k), prefill_worker="q",
                    decode_worker="d", request_id=f"r{k}", kv_timeout=3600.0, timeout=3600.0,
                    sampling=Sampling(max_tokens=4, stop_on_eos=False)))
            # Give up while one prefill runs (its first KV is in) and two wait.
            with trio.fail_after(600):
                while (prefill.statistics().running, prefill.statistics().queue_depth) != (1, 2) \
                        or decode.statistics().kv_pending_bytes == 0:
                    await trio.sleep(0.01)
            group.cancel_scope.cancel()
        # Within the orphan timer's period, whatever the cause: nothing left anywhere.
        with trio.fail_after(ORPHAN_S):
            while (prefill.busy or decode.statistics().assemblies
                   or decode.statistics().kv_pending_bytes):
                await trio.sleep(0.01)
        stats, kv = prefill.statistics(), decode.statistics()
        prefill.check_integrity()
    assert (stats.queue_depth, stats.running, stats.jobs) == (0, 0, 0)
    # The two queued ones left the queue; the running one stopped (its caller's abort, or the
    # decode worker refusing the rest of its KV, whichever came first).
    assert stats.cancelled >= 2 and stats.cancelled + stats.failures == 3
    assert (kv.assemblies, kv.kv_pending_bytes, kv.running, kv.waiting) == (0, 0, 0, 0)
    assert kv.kv_bytes_in > 0 and kv.finished == 0


@pytest.mark.trio
async def test_kv_nobody_decodes_is_dropped_by_the_timer_and_late_lanes_are_refused(
        autojump_clock: trio.testing.MockClock) -> None:
    async with in_process(parse_topology(TOPOLOGY), ["d"]) as mesh, \
            mesh.client() as client:
        decode = workers_decode(mesh)
        cfg = decode.model.cfg
        opening = KVOpen(request_id="orphan", family=cfg.family, config_hash=cfg.config_hash(),
                         dtype=decode.model.dtype_name, start=0, end=70, pieces=1)
        async with client.stream_to("d", opening, timeout=60) as sink:
            await sink.send(KVChunk(request_id="orphan", layer=0, data=b"x" * 1000))
            await sink.send(KVClose(request_id="orphan", first_token=1))
        held = decode.statistics()
        assert (held.assemblies, held.kv_pending_bytes) == (1, 1000)
        # No other transfer arrives: the timer alone drops it, within 1.25 orphan timeouts.
        await trio.sleep(ORPHAN_S * 1.3)
        dropped = decode.statistics()
        assert (dropped.assemblies, dropped.kv_pending_bytes) == (0, 0)
        assert dropped.kv_orphans_dropped == 1
        # A lane for it now is refused at once: the prefill side stops sending.
        with pytest.raises((StreamAborted, RemoteError)):
            async with client.stream_to("d", opening, timeout=60) as sink:
                await sink.send(KVChunk(request_id="orphan", layer=0, data=b"y"))
        assert decode.statistics().kv_lanes_refused == 1
        assert decode.statistics().assemblies == 0


def workers_decode(mesh: object) -> DecodeWorker:
    service = mesh.services["d"]  # type: ignore[attr-defined]
    assert isinstance(service, WorkerService)
    return service.decode
