"""Nothing lost, nothing stuck: the router over real HTTP with the real services in process.

One asyncio loop in a background thread (an anyio blocking portal) runs the cache directory,
a PrfaaS and a PD prefill worker, a PD decode worker (tiny random-init model) and
`run_router` with hypercorn on a free 127.0.0.1 port; the test thread speaks HTTP to it.
Prompts are token ids below the tiny model's vocabulary (512).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.from_thread
import httpx
import pytest

from mesh.topology import Topology, parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport
from services.cli.serve import run_service
from services.service import ServiceContext
from tests.ports import free_port
from tests.topologies import MEMORY_PORTS, mesh_toml

pytestmark = pytest.mark.slow

MAX_BATCH = 4  # the decode worker's streams at once: the router's admission limit
WORKERS = ("cachedir", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0")



def topology(http_port: int) -> Topology:
    worker = 'family = "kimi-linear", size = "tiny", checkpoint = "none", seed = 3'
    return parse_topology(mesh_toml(MEMORY_PORTS, worker=worker, options={
        "router": f"http_port = {http_port}, max_context = 1024, tick_s = 0.2",
        "pd-decode-0": f"max_streams = {MAX_BATCH}"}))


@dataclass
class Mesh:
    topology: Topology
    hub: MemoryHub = field(default_factory=MemoryHub)

    def context(self, name: str) -> ServiceContext:
        def resolve(peer: str) -> Address:
            return self.topology.address(peer.split("#", 1)[0])

        return ServiceContext(self.topology, self.topology.service(name),
                              transport=MemoryTransport(self.hub), resolve=resolve)

    async def run(self, names: tuple[str, ...], *,
                  task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as group:
            for name in names:
                await group.start(run_service, self.context(name))
            task_status.started()


def wait_ready(http: httpx.Client, seconds: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    health = http.get("/health")
    while health.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
        health = http.get("/health")
    return health


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    mesh = Mesh(topology(port))
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(mesh.run, (*WORKERS, "router"))
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=url, timeout=30.0) as http:
                assert wait_ready(http).status_code == 200
            yield url
        finally:
            future.cancel()


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        yield client


def ids(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 31) % 500 + 1 for i in range(n)]


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "prfaas", "prompt": prompt,
                                              "max_tokens": max_tokens, "temperature": 0,
                                              "ignore_eos": True})


@pytest.mark.parametrize("length", [64, 128, 192])
def test_a_repeated_prompt_of_whole_blocks_is_served_again_from_its_cache(
        http: httpx.Client, length: int) -> None:
    prompt = ids(length, salt=length)
    first, second = complete(http, prompt), complete(http, prompt)
    assert first.status_code == second.status_code == 200, second.text
    one, two = first.json(), second.json()
    assert one["choices"][0]["text"] == two["choices"][0]["text"]
    # The last token is always computed: the cache supplies the whole blocks below it.
    reusable = (length - 1) // 64 * 64
    assert one["prfaas"]["cached_tokens"] == 0
    assert two["prfaas"]["cached_tokens"] == reusable
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == reusable


def test_a_seed_the_mesh_cannot_carry_and_json_nested_too_deep_are_400s(
        http: httpx.Client) -> None:
    seed = http.post("/v1/completions", json={"model": "prfaas", "prompt": [1, 2],
                                              "max_tokens": 1, "seed": 2**64 + 1})
    assert seed.status_code == 400, seed.text
    assert seed.json()["error"]["param"] == "seed"
    deep = b'{"model": "prfaas", "max_tokens": 1, "prompt": ' + b"[" * 100_000 + \
        b"]" * 100_000 + b"}"
    nested = http.post("/v1/completions", content=deep,
                       headers={"content-type": "application/json"})
    assert nested.status_code == 400, nested.text
    assert nested.json()["error"]["param"].startswith("prompt")
    chat = b'{"model": "prfaas", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested_chat = http.post("/v1/chat/completions", content=chat,
                            headers={"content-type": "application/json"})
    assert nested_chat.status_code == 400, nested_chat.text
    assert complete(http, [1, 2, 3], max_tokens=1).status_code == 200


async def _burst(base_url: str, n: int) -> list[tuple[int, float, httpx.Response]]:
    """n requests at once; (status, seconds to the answer's headers, response) each."""
    out: list[tuple[int, float, httpx.Response]] = []

    async def one(client: httpx.AsyncClient, k: int) -> None:
        started = time.monotonic()
        body = {"model": "prfaas", "prompt": ids(40, salt=1000 + k), "max_tokens": 24,
                "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        out.append((response.status_code, time.monotonic() - started, response))

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as client, \
            anyio.create_task_group() as group:
        for k in range(n):
            group.start_soon(one, client, k)
    return out


@pytest.mark.parametrize("factor", [3, 10])
def test_overload_is_shed_with_429_and_the_admitted_requests_complete(
        base_url: str, http: httpx.Client, factor: int) -> None:
    assert wait_ready(http).status_code == 200
    results = anyio.run(_burst, base_url, factor * MAX_BATCH)
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, [r.text for _, _, r in results if r.status_code >= 500]
    assert statuses.count(200) >= MAX_BATCH and statuses.count(429) >= 1
    for status, _, response in results:
        if status == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["usage"]["completion_tokens"] == 24
    # Shed at once, not after waiting for anything: every refusal is back before the first
    # admitted request has finished (an order, which a loaded host does not flip, where a
    # bound in seconds would). Nobody waited for a KV timeout: that would be a 5xx above.
    shed = max(seconds for status, seconds, _ in results if status == 429)
    assert shed < min(seconds for status, seconds, _ in results if status == 200)
    assert http.get("/health").json()["inflight"] == 0


def test_health_says_starting_until_a_prefill_and_a_decode_worker_answer() -> None:
    port = free_port()
    mesh = Mesh(topology(port))
    url = f"http://127.0.0.1:{port}"
    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            httpx.Client(base_url=url, timeout=10.0) as http:
        router, _ = portal.start_task(mesh.run, ("cachedir", "router"))
        try:
            starting = http.get("/health")
            assert starting.status_code == 503
            assert starting.json()["status"] == "starting"
            workers, _ = portal.start_task(mesh.run, WORKERS[1:])
            try:
                ready = wait_ready(http)
                assert ready.status_code == 200 and ready.json()["status"] == "ready"
                assert complete(http, [5, 6, 7], max_tokens=2).status_code == 200
            finally:
                workers.cancel()
        finally:
            router.cancel()
