"""The router's view of the links between clusters: samples from each link's control API.

Each link service (netem/control.py) answers GET /link with its parameters and statistics;
the control loop (services/router/control.py) turns one answer per link per tick into a
`LinkSample`, which the scheduler keeps per link (`LinkBook`) so that each PrfaaS cluster is
judged by its own link to the request's PD cluster. A link that does not answer gives no
sample, and the policy holds still.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx
import msgspec

from mesh.topology import Topology
from services.router.policy import LinkSample
from services.service import link_service_of

log = logging.getLogger(__name__)

LinkProbe = Callable[[], Awaitable[LinkSample | None]]


def link_sample(view: Mapping[str, Any], now: float, link: str = "") -> LinkSample:
    """The policy's link sample from the link's GET /link answer (netem/control.py)."""
    egress = view["statistics"]["link"]["egress"]
    return LinkSample(now=now, link=link, utilisation=float(egress["utilisation"]),
                      bandwidth_bps=float(view.get("bandwidth_bps") or 0.0),
                      stalls=int(egress["stalls"]), up=bool(view["up"]),
                      backlog_s=float(egress.get("wire_backlog_s", 0.0)))


def http_link_probe(client: httpx.AsyncClient, url: str, link: str = "") -> LinkProbe:
    """Samples the link's control API; a link that does not answer gives no sample (logged
    when it stops answering and when it is back, not at every tick)."""
    answering = [True]

    async def probe() -> LinkSample | None:
        try:
            response = await client.get(url)
            response.raise_for_status()
            sample = link_sample(response.json(), anyio.current_time(), link)
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
    """GET /link of the first link service, if any."""
    for service in topology.find(kind="link"):
        port = service.options.get("control_port", 8474)
        return f"http://{service.host}:{port}/link"
    return None


def link_urls(topology: Topology) -> dict[str, str]:
    """GET /link of every link of the topology, by link name."""
    out = {}
    for link in topology.links:
        service = link_service_of(topology, link)
        port = service.options.get("control_port", 8474)
        out[link.name] = f"http://{service.host}:{port}/link"
    return out


class LinkEnds(msgspec.Struct, frozen=True):
    """A link of the topology: its name and the clusters it joins (a: PrfaaS side)."""

    name: str
    a: str
    b: str


def link_ends(topology: Topology) -> tuple[LinkEnds, ...]:
    return tuple(LinkEnds(link.name, link.a, link.b) for link in topology.links)


class LinkBook:
    """The latest sample of each link, its recent stalls (over `stall_window_s`), and the
    links held back from new offload after KV stalled on them (`hold`)."""

    def __init__(self, links: Sequence[LinkEnds], stall_window_s: float) -> None:
        self._ends = {(e.a, e.b): e.name for e in links}
        self._ends.update({(e.b, e.a): e.name for e in links})
        self.stall_window_s = stall_window_s
        self._samples: dict[str, LinkSample] = {}
        self._stalls: dict[str, deque[tuple[float, int]]] = {}
        self._held: dict[str, float] = {}  # link -> until when it takes no new offload

    def observe(self, sample: LinkSample) -> None:
        self._samples[sample.link] = sample
        history = self._stalls.setdefault(sample.link, deque())
        history.append((sample.now, sample.stalls))
        while history and history[0][0] < sample.now - self.stall_window_s:
            history.popleft()

    def between(self, a: str, b: str) -> str:
        """The name of the link joining clusters a and b ("" when none is known)."""
        return self._ends.get((a, b), "")

    def sample(self, a: str, b: str) -> LinkSample | None:
        """The latest sample of the link between a and b; an unnamed sample stands for any."""
        name = self.between(a, b)
        return self._samples.get(name) or self._samples.get("")

    def hold(self, a: str, b: str, until: float) -> None:
        """KV stalled on the link between a and b: it takes no new offload until `until`."""
        self.hold_link(self.between(a, b), until)

    def hold_link(self, name: str, until: float) -> None:
        self._held[name] = max(until, self._held.get(name, until))

    def held(self, a: str, b: str, now: float) -> bool:
        return self._held.get(self.between(a, b), now) > now

    def recent_stalls(self, a: str, b: str) -> int:
        name = self.between(a, b)
        history = self._stalls.get(name) or self._stalls.get("")
        return history[-1][1] - history[0][1] if history else 0
