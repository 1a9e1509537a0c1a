"""The link's control API (in-process ASGI) and `serve_link` on real loopback sockets."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
import trio
import trio.testing
from anyio.abc import SocketStream
from netem_channels import proxied_link, pumped, send_then_eof
from prometheus_client import REGISTRY, generate_latest

from netem.control import LinkEndpoints, create_control_app, serve_link
from netem.params import LinkParamError, LinkParams
from netem.proxy import LinkProxy, ProxyStatistics, Route
from netem.shaper import Direction, LinkShaper

JSON = {"content-type": "application/json"}


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
        response = await client.post("/link", content=b"{nope", headers=JSON)
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
    assert "\nprocess_resident_memory_bytes " in text and "\nprocess_open_fds " in text
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


TOKEN = "s3cret-token-for-the-link-0123456789"


@asynccontextmanager
async def guarded_client(
    admin_token: str | None = None, loopback_only: bool = False, base_url: str = "http://link"
) -> AsyncIterator[tuple[httpx.AsyncClient, LinkShaper]]:
    shaper = LinkShaper(LinkParams(), anyio.current_time, random.Random(0))
    proxy = LinkProxy([Route(9001, 9002)], shaper)
    app = create_control_app(
        proxy, name="link", admin_token=admin_token, loopback_only=loopback_only
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
        yield client, shaper


@pytest.mark.trio
async def test_token_guards_every_write_but_not_reads() -> None:
    async with guarded_client(admin_token=TOKEN) as (client, shaper):
        missing = await client.post("/link", json={"delay_ms": 5})
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in missing.json()["error"]
        wrong = {"authorization": f"Bearer {TOKEN[:-1]}x"}
        assert (await client.post("/link", json={"delay_ms": 5}, headers=wrong)).status_code == 401
        for method, path in [("POST", "/reset"), ("DELETE", "/proxies/link/toxics/x")]:
            assert (await client.request(method, path)).status_code == 401
        assert shaper.params == LinkParams()
        assert (await client.get("/link")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        right = {"authorization": f"Bearer {TOKEN}"}
        ok = await client.post("/link", json={"delay_ms": 5}, headers=right)
        assert ok.status_code == 200
        assert shaper.params.delay_s == pytest.approx(0.005)
        assert (await client.post("/reset", headers=right)).status_code == 204


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        ({"origin": "http://evil.example", "content-type": "text/plain"}, 403, "cross-origin"),
        ({"origin": "http://evil.example", "content-type": "application/json"}, 403, "Origin"),
        ({"origin": "null", "content-type": "application/json"}, 403, "cross-origin"),
        ({"origin": "https://link", "content-type": "application/json"}, 403, "cross-origin"),
        ({"content-type": "text/plain"}, 415, "application/json, got 'text/plain'"),
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        ({}, 415, "application/json, got None"),
    ],
)
@pytest.mark.trio
async def test_cross_origin_and_non_json_writes_are_refused(
    headers: dict[str, str], status: int, message: str
) -> None:
    async with guarded_client() as (client, shaper):
        body = b'{"bandwidth_bps": 1000}'
        response = await client.post("/link", content=body, headers=headers)
        assert response.status_code == status
        assert message in response.json()["error"]
        assert shaper.params == LinkParams()
        # A read from the same page is not a write: it stays allowed.
        assert (await client.get("/link", headers=headers)).status_code == 200


@pytest.mark.trio
async def test_same_origin_and_bodiless_writes_pass() -> None:
    async with guarded_client() as (client, shaper):
        same = {"origin": "http://link", "content-type": "application/json; charset=utf-8"}
        response = await client.post("/link", content=b'{"loss": 0.5}', headers=same)
        assert response.status_code == 200
        assert shaper.params.loss_rate == 0.5
        reset = await client.post("/reset", headers={"origin": "http://link:80"})
        assert reset.status_code == 204
        assert shaper.params == LinkParams()


@pytest.mark.parametrize(
    ("base_url", "status"),
    [
        ("http://127.0.0.1:8474", 200),
        ("http://localhost:8474", 200),
        ("http://[::1]:8474", 200),
        ("http://rebound.evil.example:8474", 403),
        ("http://10.0.0.5:8474", 403),
    ],
)
@pytest.mark.trio
async def test_open_loopback_api_refuses_writes_for_other_host_names(
    base_url: str, status: int
) -> None:
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 sends its name as Host."""
    async with guarded_client(loopback_only=True, base_url=base_url) as (client, shaper):
        origin = {"origin": base_url}
        response = await client.post("/link", json={"delay_ms": 7}, headers=origin)
        assert response.status_code == status
        assert (shaper.params.delay_s == 0.007) is (status == 200)


@pytest.mark.parametrize(
    ("control_host", "admin_token", "message"),
    [
        ("0.0.0.0", None, "control_host '0.0.0.0' is reachable beyond loopback: set admin_token"),
        ("::", None, "beyond loopback"),
        ("link.example", None, "beyond loopback"),
        ("0.0.0.0", "", "admin_token must be at least 16"),
        ("127.0.0.1", "short", "admin_token must be at least 16"),
        ("127.0.0.1", "has a space in the token", "no spaces"),
    ],
)
@pytest.mark.trio
async def test_serve_link_refuses_an_unguarded_or_bad_control_config(
    control_host: str, admin_token: str | None, message: str
) -> None:
    with pytest.raises(LinkParamError, match=message):
        await serve_link(
            [Route(0, 1)], LinkParams(), 0, control_host=control_host, admin_token=admin_token
        )


@pytest.mark.trio
async def test_serve_link_with_a_token_guards_writes_on_real_sockets() -> None:
    async with anyio.create_task_group() as tg:
        endpoints: LinkEndpoints = await tg.start(
            lambda task_status: serve_link(
                [Route(0, 1)], LinkParams(), 0, admin_token=TOKEN, task_status=task_status
            )
        )
        with anyio.fail_after(20):
            base = f"http://127.0.0.1:{endpoints.control[1]}"
            async with httpx.AsyncClient(base_url=base) as client:
                assert (await client.post("/link", json={"delay_ms": 5})).status_code == 401
                auth = {"authorization": f"Bearer {TOKEN}"}
                response = await client.post("/link", json={"delay_ms": 5}, headers=auth)
                assert response.json()["delay_ms"] == pytest.approx(5)
                huge = b"[" * 100_000 + b"]" * 100_000
                response = await client.post("/link", content=huge, headers=auth | JSON)
                assert response.status_code == 413
                assert "body is larger than 65536 bytes" in response.json()["error"]
        tg.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_token_protected_api_refuses_a_foreign_host_reads_included() -> None:
    """DNS rebinding past the token: a page whose name now resolves to the API's address
    reads it with its own name as Host; only the API's names (bind, dialled, loopback) pass."""
    async with anyio.create_task_group() as tg:
        endpoints: LinkEndpoints = await tg.start(
            lambda task_status: serve_link(
                [Route(0, 1)], LinkParams(), 0, admin_token=TOKEN,
                control_names=("link.example",), task_status=task_status
            )
        )
        with anyio.fail_after(20):
            base = f"http://127.0.0.1:{endpoints.control[1]}"
            auth = {"authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base) as client:
                for host in ("evil.example", "evil.example:8474", "10.0.0.5"):
                    rebound = {"host": host}
                    for path in ("/link", "/metrics", "/proxies"):
                        refused = await client.get(path, headers=rebound | auth)
                        assert refused.status_code == 403, (host, path)
                        assert "DNS rebinding" in refused.json()["error"]
                    write = await client.post("/link", json={"delay_ms": 5},
                                              headers=rebound | auth)
                    assert write.status_code == 403
                assert (await client.get("/link")).json()["delay_ms"] == 0
                for host in ("127.0.0.1", "localhost:1", "link.example:8474"):
                    ok = await client.post("/link", json={"delay_ms": 5},
                                           headers={"host": host} | auth)
                    assert ok.status_code == 200, host
                    assert (await client.get("/link", headers={"host": host})).status_code == 200
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/link", b'{"delay_ms": 1' + b"0" * 400 + b"}", "delay_ms must be a number >= 0"),
        ("/link", b'{"bandwidth_bps": -1' + b"0" * 400 + b"}", "got <integer of 1329 bits>"),
        ("/link", b'{"bandwidth_bps": 1e400}', "Number out of range"),
        ("/link", b'{"jitter_ms": NaN}', "body is not valid JSON"),
        ("/link", b'{"rto_ms": -Infinity}', "body is not valid JSON"),
        ("/link", b'{"bandwidth_bps": 0.001}', "bandwidth_bps must be 0 (unshaped) or >= 1"),
        ("/link", b'{"delay_ms": [1]}', "delay_ms must be a number >= 0 and <= 3.6e+06, got [1]"),
        ("/link", b'{"loss": {"a": {"b": {"c": {"d": 1}}}}}', "loss must be a number"),
        ("/link", b"[" * 20_000 + b"]" * 20_000, "body is nested too deeply"),
        ("/link", b'"' + b"x" * 60_000 + b'"', "body must be a JSON object, got 'xxxx"),
        ("/proxies/link", b'{"enabled": "yes"}', "enabled must be true or false, got 'yes'"),
        ("/proxies/link/toxics", b'{"type": "latency"}', "needs a non-zero latency or jitter"),
        (
            "/proxies/link/toxics",
            b'{"type": "bandwidth", "attributes": {"rate": 0}}',
            "a bandwidth toxic needs a non-zero rate",
        ),
        (
            "/proxies/link/toxics",
            b'{"type": "bandwidth", "attributes": {"rate": 1e-9}}',
            "bandwidth_bps must be 0 (unshaped) or >= 1",
        ),
        (
            "/proxies/link/toxics",
            b'{"type": "latency", "name": {"x": 1}, "attributes": {"latency": 5}}',
            "name must be a string of at most 200 characters, got {'x': 1}",
        ),
        ("/proxies/link/toxics", b'{"type": {"t": 1}}', "type must be one of"),
        ("/proxies/link/toxics", b'{"type": "latency", "stream": [1]}', "stream must be"),
    ],
)
@pytest.mark.trio
async def test_bad_bodies_get_a_400_naming_the_parameter_never_a_500(
    path: str, body: bytes, message: str
) -> None:
    async with control_client() as (client, shaper):
        response = await client.post(path, content=body, headers=JSON)
        assert response.status_code in (400, 413)
        assert response.json()["status"] == response.status_code
        assert message in response.json()["error"]
        assert len(response.content) < 1000
        assert shaper.params == LinkParams()
        assert (await client.get("/link")).status_code == 200


@pytest.mark.trio
async def test_updating_a_toxic_to_zero_removes_it_without_a_500() -> None:
    async with control_client() as (client, shaper):
        latency = {"type": "latency", "name": "wan", "attributes": {"latency": 20}}
        assert (await client.post("/proxies/link/toxics", json=latency)).status_code == 200
        zero = {"attributes": {"latency": 0}}
        response = await client.post("/proxies/link/toxics/wan", json=zero)
        assert response.status_code == 200
        assert response.json()["attributes"] == {"latency": 0.0, "jitter": 0.0}
        assert shaper.params == LinkParams()
        assert (await client.get("/proxies/link/toxics")).json() == []


@pytest.mark.trio
async def test_reset_after_a_slow_spell_drains_the_backlog_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 13 through the API: 10 s at 1 kbit/s with 3 MB offered, then POST /reset."""
    _, proxy = proxied_link(LinkParams(), seed=0)
    transport = httpx.ASGITransport(app=create_control_app(proxy, name="link"))
    payload = os.urandom(3_000_000)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://link") as client,
        pumped(proxy) as (app, server, nursery),
    ):
        assert (await client.post("/link", json={"bandwidth_bps": 1000})).status_code == 200
        nursery.start_soon(send_then_eof, app, payload)
        await trio.sleep(10.0)
        link = (await client.get("/link")).json()["statistics"]["link"]["egress"]
        assert link["bytes_out"] < 1250 and link["wire_backlog_s"] > 8000
        assert (await client.post("/reset")).status_code == 204
        await server.send_eof()
        received, last = await server.receive_all()
        await app.receive_all()
        link = (await client.get("/link")).json()["statistics"]["link"]["egress"]
    assert received == payload
    # Unshaped from t = 10 s: what waited leaves at once, the rest passes straight through.
    assert last == pytest.approx(10.0, abs=1e-9)
    assert (link["bytes_out"], link["queued_bytes"], link["wire_backlog_s"]) == (len(payload), 0, 0)
    proxy.check_integrity()
