"""The router's link samples: the link's GET /link answer read into the policy's LinkSample."""

from __future__ import annotations

import httpx
import pytest

from mesh.topology import parse_topology
from services.router.control import http_link_probe, link_sample, link_url


def test_link_samples_read_the_egress_statistics() -> None:
    view = {"bandwidth_bps": 2e8, "up": True, "statistics": {"link": {"egress": {
        "utilisation": 0.25, "stalls": 3}}}}
    sample = link_sample(view, 12.0)
    assert (sample.utilisation, sample.stalls, sample.bandwidth_bps, sample.up) == (
        0.25, 3, 2e8, True)
    assert link_sample({**view, "bandwidth_bps": None}, 0.0).bandwidth_bps == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_link_probe_reads_the_link_api_and_survives_its_absence(
        anyio_backend: str) -> None:
    answers = [500, 200]

    def handler(request: httpx.Request) -> httpx.Response:
        status = answers.pop(0) if answers else 200
        view = {"bandwidth_bps": 1e8, "up": False, "statistics": {"link": {"egress": {
            "utilisation": 0.5, "stalls": 2}}}}
        return httpx.Response(status, json=view)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        probe = http_link_probe(client, "http://link/link")
        assert await probe() is None
        sample = await probe()
        assert sample is not None and (sample.utilisation, sample.up) == (0.5, False)


def test_link_url_is_the_first_link_services_control_api() -> None:
    topology = parse_topology("""
[[services]]
name = "router"
kind = "router"
port = 7100
[[services]]
name = "link"
kind = "link"
port = 7140
options = { control_port = 8475 }
""")
    assert link_url(topology) == "http://127.0.0.1:8475/link"
    assert link_url(parse_topology('[[services]]\nname = "r"\nkind = "router"\nport = 1\n')) \
        is None
