"""Cache directory service: workers' reports reach it, queries and plans answer from them,
evictions are applied, it rebuilds itself after a restart, and publishes CacheActivity."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import trio

from mesh.node import Node
from mesh.topology import parse_topology
from services.cachedir.service import CacheDirService
from services.cli.launch import InProcessMesh, in_process
from services.cli.send import decode_has_tokens, drive_request
from services.contract.events import CacheActivity
from services.contract.messages import PlanQuery, PlanReply, PrefixQuery, PrefixReply, Subscribe
from services.contract.sampling import Sampling
from services.worker.prefix_store import prompt_hashes
from services.worker.service import WorkerService
from tests.prompts import tokens
from tests.topologies import mesh_toml

TOPOLOGY = parse_topology(mesh_toml(
    {"cachedir": 1, "p": 2, "d": 3},
    worker='family = "qwen-next", size = "tiny", checkpoint = "none"',
    options={"p": "cache_mib = 0.25"}))
SAMPLING = Sampling(max_tokens=8, stop_on_eos=False)


def service(mesh: InProcessMesh, name: str) -> object:
    return mesh.services[name]


async def one_request(client: Node, prompt: list[int], rid: str) -> None:
    has = await decode_has_tokens(client, "cachedir", prompt, "d", 64)
    await drive_request(client, prompt, prefill_worker="p", decode_worker="d", request_id=rid,
                        sampling=SAMPLING, decode_has=has)


async def one_prompt_reported(client: Node, directory: CacheDirService) -> list[int]:
    """A 200-token prompt served once, returned when both workers' blocks of it are in the
    directory: 3 blocks on p, 3 on d (200 + 7 tokens)."""
    prompt = tokens(200)
    await one_request(client, prompt, "r1")
    await settled(directory, 6)
    return prompt


@asynccontextmanager
async def directory_mesh() -> AsyncIterator[tuple[InProcessMesh, Node, CacheDirService]]:
    """The directory, then p and d, in process; a client of theirs; the directory service."""
    async with in_process(TOPOLOGY, ["cachedir", "p", "d"]) as mesh, mesh.client() as client:
        directory = service(mesh, "cachedir")
        assert isinstance(directory, CacheDirService)
        yield mesh, client, directory


async def settled(directory: CacheDirService, blocks: int) -> None:
    """Casts are one-way: wait until the directory has applied them."""
    while directory.statistics().block_entries < blocks:
        await trio.sleep(0.01)


@pytest.mark.trio
async def test_reports_answer_queries_and_plans() -> None:
    async with directory_mesh() as (_, client, directory):
        with trio.fail_after(60):
            prompt = await one_prompt_reported(client, directory)
            hashes = prompt_hashes(prompt + tokens(60, 1), 64)
            match = (await client.call("cachedir", PrefixQuery(hashes), PrefixReply)).match
            plan = (await client.call("cachedir", PlanQuery(hashes=hashes, target_worker="d"),
                                      PlanReply)).plan
            # In process (the simulation's router asks it so), the same answer.
            assert directory.lookup(PrefixQuery(hashes)).match == match
        directory.check_integrity()
    held = {(w.worker, w.blocks_held, w.blocks_resumable) for w in match.workers}
    assert held == {("p", 3, 3), ("d", 3, 0)}
    assert (plan.target_held, plan.send, plan.source_worker) == (3, [3], "p")


@pytest.mark.trio
async def test_evictions_reach_the_directory() -> None:
    async with directory_mesh() as (mesh, client, directory):
        worker = service(mesh, "p")
        assert isinstance(worker, WorkerService)
        with trio.fail_after(60):
            for i in range(3):
                await one_request(client, tokens(130, 10 + i), f"e{i}")
            oldest = prompt_hashes(tokens(130, 10), 64)
            while "p" in {w.worker for w in directory.directory.longest_prefix(oldest).workers}:
                await trio.sleep(0.01)
    evictions = worker.store.statistics().evictions
    assert evictions > 0
    assert directory.statistics().blocks_evicted == 2 * evictions


@pytest.mark.trio
async def test_a_restarted_directory_rebuilds_from_the_workers() -> None:
    async with directory_mesh() as (mesh, client, old):
        with trio.fail_after(60):
            prompt = await one_prompt_reported(client, old)
            fresh_node = mesh.client("cachedir-restarted")
            fresh = CacheDirService(fresh_node, old.workers)
            async with fresh_node:
                assert fresh.statistics().block_entries == 0
                assert await fresh.rebuild() == 2
        fresh.check_integrity()
    hashes = prompt_hashes(prompt, 64)
    assert fresh.directory.longest_prefix(hashes) == old.directory.longest_prefix(hashes)


@pytest.mark.trio
async def test_workers_started_first_are_asked_and_activity_is_published() -> None:
    async with in_process(TOPOLOGY, ["p", "d", "cachedir"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            async with client.open_stream("cachedir", Subscribe(maxlen=64)) as events, \
                    anyio.create_task_group() as tg:
                tg.start_soon(one_request, client, tokens(140), "r")
                seen: set[str] = set()
                async for event in events:
                    assert isinstance(event, CacheActivity)
                    if event.kind == "stored" and event.blocks > 0:
                        seen.add(event.worker)
                        assert event.total_blocks >= event.blocks
                    if seen == {"p", "d"}:
                        break
    assert seen == {"p", "d"}
