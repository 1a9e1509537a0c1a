"""The router's link samples: the link's GET /link answer read into the policy's LinkSample."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from mesh.topology import parse_topology
from services.router.control import http_link_probe, link_sample, link_url


def test_link_samples_read_what_the_transport_tells_and_never_the_rate() -> None:
    view = {"bandwidth_bps": 2e8, "up": True, "statistics": {"link": {"egress": {
        "utilisation": 0.25, "stalls": 3, "queued_bytes": 4096, "wire_backlog_s": 1.5}}}}
    sample = link_sample(view, 12.0)
    assert (sample.stalls, sample.up, sample.queued_bytes) == (3, True, 4096)
    # The rate, the utilisation and the queue's wire time (reckoned at the rate) stay out.
    assert not {"bandwidth_bps", "utilisation", "backlog_s"} & set(
        msgspec.structs.asdict(sample))


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
        assert sample is not None and (sample.stalls, sample.up) == (2, False)


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
