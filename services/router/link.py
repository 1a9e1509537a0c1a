"""The router's view of the PrfaaS egress link: samples from the link's control API.

The link service (netem/control.py) answers GET /link with its parameters and statistics;
the control loop (services/router/control.py) turns one answer per tick into the policy's
`LinkSample`. A link that does not answer gives no sample, and the policy holds still.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx

from mesh.topology import Topology
from services.router.policy import LinkSample

log = logging.getLogger(__name__)

LinkProbe = Callable[[], Awaitable[LinkSample | None]]


def link_sample(view: Mapping[str, Any], now: float) -> LinkSample:
    """The policy's link sample from the link's GET /link answer (netem/control.py)."""
    egress = view["statistics"]["link"]["egress"]
    return LinkSample(now=now, utilisation=float(egress["utilisation"]),
                      bandwidth_bps=float(view.get("bandwidth_bps") or 0.0),
                      stalls=int(egress["stalls"]), up=bool(view["up"]))


def http_link_probe(client: httpx.AsyncClient, url: str) -> LinkProbe:
    """Samples the link's control API; a link that does not answer gives no sample (logged
    when it stops answering and when it is back, not at every tick)."""
    answering = [True]

    async def probe() -> LinkSample | None:
        try:
            response = await client.get(url)
            response.raise_for_status()
            sample = link_sample(response.json(), anyio.current_time())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if answering[0]:
                log.warning("no link samples from %s: %s", url, exc)
            answering[0] = False
            return None
        if not answering[0]:
            log.info("link samples from %s are back", url)
        answering[0] = True
        return sample

    return probe


def link_url(topology: Topology) -> str | None:
    """GET /link of the first link service (the PrfaaS egress link), if any."""
    for service in topology.find(kind="link"):
        port = service.options.get("control_port", 8474)
        return f"http://{service.host}:{port}/link"
    return None
