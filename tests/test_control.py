"""The link's control API (in-process ASGI) and `serve_link` on real loopback sockets."""

from __future__ import annotations

import gc
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import SocketStream
from prometheus_client import REGISTRY, generate_latest

from netem.control import LinkEndpoints, create_control_app, serve_link
from netem.proxy import LinkProxy, ProxyStatistics, Route
from netem.shaper import Direction, LinkParams, LinkShaper


@asynccontextmanager
async def control_client() -> AsyncIterator[tuple[httpx.AsyncClient, LinkShaper]]:
    shaper = LinkShaper(LinkParams(), anyio.current_time, random.Random(0))
    proxy = LinkProxy([Route(9001, 9002)], shaper)
    transport = httpx.ASGITransport(app=create_control_app(proxy, name="link"))
    async with httpx.AsyncClient(transport=transport, base_url="http://link") as client:
        yield client, shaper


@pytest.mark.trio
async def test_get_and_post_link_apply_live() -> None:
    async with control_client() as (client, shaper):
        body = (await client.get("/link")).json()
        assert body["bandwidth_bps"] is None and body["up"] is True
        assert body["statistics"]["link"]["egress"]["bytes_out"] == 0
        update = {"bandwidth_bps": 2e8, "delay_ms": 20, "jitter_ms": 1.5, "loss": 0.01}
        response = await client.post("/link", json=update)
        assert response.status_code == 200
        assert response.json()["delay_ms"] == pytest.approx(20)
        assert shaper.params == LinkParams(
            bandwidth_bps=2e8, delay_s=0.020, jitter_s=0.0015, loss_rate=0.01
        )
        await client.post("/link", json={"up": False, "bandwidth_bps": 0})
        assert shaper.params.up is False and shaper.params.bandwidth_bps is None
        assert shaper.params.delay_s == pytest.approx(0.020)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"delay_ms": -5}, "delay_ms must be a number >= 0 and <= 3.6e+06, got -5"),
        ({"loss": 2}, "loss must be a number >= 0 and <= 1, got 2"),
        ({"rto_ms": 0}, "rto_ms must be a number > 0 "),
        (
            {"bandwidth_bps": "fast"},
            "bandwidth_bps must be a number >= 0 and <= 1e+15, got 'fast'",
        ),
        ({"up": "no"}, "up must be true or false, got 'no'"),
        ({"latency": 5}, "unknown parameter 'latency'"),
        ([1, 2], "body must be a JSON object, got [1, 2]"),
    ],
)
@pytest.mark.trio
async def test_post_link_rejects_bad_input_naming_it(body: Any, message: str) -> None:
    async with control_client() as (client, shaper):
        response = await client.post("/link", json=body)
        assert response.status_code == 400
        assert response.json()["status"] == 400
        assert message in response.json()["error"]
        assert shaper.params == LinkParams()


@pytest.mark.trio
async def test_post_link_rejects_invalid_json() -> None:
    async with control_client() as (client, _):
        response = await client.post("/link", content=b"{nope")
        assert response.status_code == 400
        assert "body is not valid JSON" in response.json()["error"]


@pytest.mark.trio
async def test_toxiproxy_vocabulary_round_trip() -> None:
    async with control_client() as (client, shaper):
        proxies = (await client.get("/proxies")).json()
        assert proxies["link"]["listen"] == "127.0.0.1:9001"
        assert proxies["link"]["upstream"] == "127.0.0.1:9002"
        assert proxies["link"]["toxics"] == []

        latency = {"type": "latency", "name": "wan", "attributes": {"latency": 20, "jitter": 2}}
        created = (await client.post("/proxies/link/toxics", json=latency)).json()
        assert created["name"] == "wan" and created["attributes"]["jitter"] == pytest.approx(2)
        assert (shaper.params.delay_s, shaper.params.jitter_s) == pytest.approx((0.020, 0.002))
        conflict = await client.post("/proxies/link/toxics", json=latency)
        assert conflict.status_code == 409

        rate = {"type": "bandwidth", "attributes": {"rate": 1000}}
        created = (await client.post("/proxies/link/toxics", json=rate)).json()
        assert created["name"] == "bandwidth_downstream"
        assert shaper.params.bandwidth_bps == pytest.approx(8e6)

        update = {"attributes": {"latency": 50}}
        updated = (await client.post("/proxies/link/toxics/wan", json=update)).json()
        assert updated["attributes"]["latency"] == pytest.approx(50)
        assert shaper.params.jitter_s == pytest.approx(0.002)

        listed = (await client.get("/proxies/link/toxics")).json()
        assert {toxic["name"] for toxic in listed} == {"wan", "bandwidth_downstream"}
        assert (await client.delete("/proxies/link/toxics/wan")).status_code == 204
        assert (shaper.params.delay_s, shaper.params.jitter_s) == (0.0, 0.0)
        assert shaper.params.bandwidth_bps == pytest.approx(8e6)

        await client.post("/proxies/link", json={"enabled": False})
        assert shaper.params.up is False
        assert (await client.get("/proxies/link")).json()["enabled"] is False
        assert (await client.post("/reset")).status_code == 204
        assert shaper.params == LinkParams()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("GET", "/proxies/other", None, 404, "proxy not found: 'other'"),
        ("GET", "/proxies/link/toxics/none", None, 404, "toxic not found: 'none'"),
        ("POST", "/proxies/link/toxics", {"type": "slicer"}, 400, "got 'slicer'"),
        ("POST", "/proxies/link/toxics", {"type": "latency", "toxicity": 0.5}, 400, "toxicity"),
        (
            "POST",
            "/proxies/link/toxics",
            {"type": "latency", "attributes": {"latency": -1}},
            400,
            "latency must be a number >= 0 ",
        ),
        (
            "POST",
            "/proxies/link/toxics",
            {"type": "bandwidth", "attributes": {"rate": 1, "burst": 2}},
            400,
            "unknown bandwidth attribute 'burst'",
        ),
        ("POST", "/proxies/link", {"listen": "0.0.0.0:1"}, 400, "only 'enabled'"),
    ],
)
@pytest.mark.trio
async def test_toxiproxy_errors(
    method: str, path: str, body: object, status: int, message: str
) -> None:
    async with control_client() as (client, shaper):
        response = await client.request(method, path, json=body)
        assert response.status_code == status
        assert message in response.json()["error"]
        assert shaper.params == LinkParams()


@pytest.mark.trio
async def test_metrics_come_from_statistics_on_a_private_registry() -> None:
    async with control_client() as (client, shaper):
        flow = shaper.open_flow(Direction.EGRESS)
        shaper.passthrough(flow, 1234)
        text = (await client.get("/metrics")).text
    assert 'prfaas_link_bytes_out_total{direction="egress",link="link"} 1234.0' in text
    assert 'prfaas_link_up{link="link"} 1.0' in text
    assert "prfaas_link_utilisation_ratio" in text
    assert b"prfaas_link" not in generate_latest(REGISTRY)


async def echo_handler(stream: SocketStream) -> None:
    async with stream:
        try:
            while True:
                await stream.send(await stream.receive())
        except anyio.EndOfStream:
            await stream.send_eof()


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
async def test_serve_link_runs_proxy_and_control_together(anyio_backend: str) -> None:
    reports: list[ProxyStatistics] = []
    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as echo:
        port = echo.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo.serve, echo_handler)
            endpoints: LinkEndpoints = await tg.start(
                lambda task_status: serve_link(
                    [Route(0, port)],
                    LinkParams(),
                    control_port=0,
                    on_stats=reports.append,
                    stats_interval_s=0.01,
                    task_status=task_status,
                )
            )
            with anyio.fail_after(20):
                base = f"http://127.0.0.1:{endpoints.control[1]}"
                async with httpx.AsyncClient(base_url=base) as client:
                    response = await client.post("/link", json={"delay_ms": 5})
                    assert response.json()["delay_ms"] == pytest.approx(5)
                    async with await anyio.connect_tcp(*endpoints.routes[0]) as stream:
                        await stream.send(b"ping")
                        assert await stream.receive() == b"ping"
                    body = (await client.get("/link")).json()
                    assert body["statistics"]["link"]["egress"]["bytes_out"] == 4
                while not reports:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    gc.collect()
    assert reports[-1].connections_total >= 0
