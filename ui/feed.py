"""The dashboard on the mesh: its live feed of every service's events, and the `ui` runner.

`MeshFeed` is the dashboard's `EventSource` for a real mesh. Its node opens a `Subscribe`
stream to each service that publishes events (router, cache directory, workers, links) and
hands every event to the dashboard as it arrives. A peer that is not up yet, restarts, or
sends something that is not an event costs only its own stream: that stream is reopened
with exponential backoff while the others go on. `statistics()` says, per peer, whether it
is connected, how often it was (re)connected and how many events it gave.

`run_ui` is the `ui` kind's runner of `prfaas serve`: the feed, the controls forwarded to the
link's control API and the router's admin API (addresses from the topology), and the
dashboard on options.http_port.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import ClassVar, cast

import anyio
import anyio.abc
import msgspec

from mesh.errors import ConfigError, MeshError
from mesh.node import Node
from mesh.topology import Topology
from mesh.transport import Address
from services.contract.access import SUPERVISOR_URL_ENV, token_from_env
from services.contract.events import EVENT_TYPES, AnyEvent
from services.contract.messages import MAX_SUBSCRIBE_MAXLEN, Subscribe
from services.contract.types import DEFAULT_TOKEN_SCALE
from services.service import (
    WORKER_KINDS,
    ServiceContext,
    StatisticsSource,
    http_bind_host,
    http_dial_host,
    serve_metrics,
)
from ui.config import DashboardConfig
from ui.controls import HttpControlClient
from ui.peer_clock import peer_offset
from ui.serve import serve_ui

log = logging.getLogger(__name__)

# The kinds whose services publish dashboard events (echo serves an empty stream; ui reads).
EVENT_KINDS = frozenset({"router", "cachedir", "link"}) | WORKER_KINDS
Publish = Callable[[AnyEvent], None]


class FeedConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """maxlen: events a service buffers for us before it drops its oldest (Subscribe);
    retry_min_s / retry_max_s: the backoff between attempts to (re)open a peer's stream;
    wall_clock: restamp events from the monotonic clock to wall time (see `MeshFeed`)."""

    maxlen: int = 4096
    retry_min_s: float = 0.25
    retry_max_s: float = 4.0
    wall_clock: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.maxlen <= MAX_SUBSCRIBE_MAXLEN:
            raise ConfigError(f"FeedConfig.maxlen must be 1..{MAX_SUBSCRIBE_MAXLEN}, got "
                              f"{self.maxlen}")
        if not 0 < self.retry_min_s <= self.retry_max_s:
            raise ConfigError(f"FeedConfig needs 0 < retry_min_s <= retry_max_s, got "
                              f"{self.retry_min_s} and {self.retry_max_s}")


class PeerFeedStatistics(msgspec.Struct, frozen=True):
    """One peer's stream: up now or not, how often opened, events taken, how often it failed
    (`MeshFeed.last_error` says how)."""

    counters: ClassVar[frozenset[str]] = frozenset({"connects", "failures", "events",
                                                    "rejected"})

    peer: str
    connected: bool
    connects: int  # streams opened (the first one and every reconnect)
    failures: int  # attempts that failed or streams that broke
    events: int  # events handed to the dashboard
    rejected: int  # items that were no event, or that the dashboard refused
    clock_offset_s: float  # added to the peer's `ts` to read the dashboard's clock


class MeshFeedStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset({"events", "failures", "rejected"})

    peers: tuple[PeerFeedStatistics, ...]
    connected: int  # peers whose stream is open
    events: int
    failures: int
    rejected: int


class _PeerState:
    """The mutable counters behind one `PeerFeedStatistics`."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.connected = False
        self.connects = self.failures = self.events = self.rejected = 0
        self.clock_offset_s = 0.0
        self.last_error = ""

    def freeze(self) -> PeerFeedStatistics:
        return PeerFeedStatistics(self.peer, self.connected, self.connects, self.failures,
                                  self.events, self.rejected, self.clock_offset_s)


def event_peers(topology: Topology) -> list[str]:
    """The services of `topology` that publish dashboard events, in file order."""
    return [s.name for s in topology.services if s.kind in EVENT_KINDS]


class MeshFeed:
    """The dashboard's `EventSource` over a mesh: one `Subscribe` stream per peer, merged.

    The node must be running (`async with node:`) while `run` runs; it needs no listener.
    Each service stamps events with its own clock (live: its machine's CLOCK_MONOTONIC); each
    stream's events are moved onto this process's clock by the offset read when it opened
    (ui/peer_clock.py), so that timelines line up across machines, and then by one more
    offset onto wall time, so the page can show times of day.
    """

    def __init__(self, node: Node, peers: Iterable[str], config: FeedConfig | None = None):
        self.node = node
        self.config = config or FeedConfig()
        self._wall_offset = time.time() - time.monotonic() if self.config.wall_clock else 0.0
        self._peers = {peer: _PeerState(peer) for peer in peers}
        if not self._peers:
            raise ConfigError("MeshFeed needs at least one peer to subscribe to, got none")

    async def run(self, publish: Publish) -> None:
        """Follows every peer until cancelled; no peer's failure ends it."""
        async with anyio.create_task_group() as tasks:
            for state in self._peers.values():
                tasks.start_soon(self._follow, state, publish)

    async def _follow(self, state: _PeerState, publish: Publish) -> None:
        delay = self.config.retry_min_s
        while True:
            opened = anyio.current_time()
            try:
                await self._read(state, publish)
            except MeshError as exc:
                state.failures += 1
                if state.last_error != str(exc):
                    log.info("events of %s unavailable: %s", state.peer, exc)
                state.last_error = str(exc)
            finally:
                was_up, state.connected = state.connected, False
            # A stream that lived (a restart, not a peer refusing at once): retry quickly.
            if was_up and anyio.current_time() - opened >= self.config.retry_max_s:
                delay = self.config.retry_min_s
            await anyio.sleep(delay)
            delay = min(2 * delay, self.config.retry_max_s)

    async def _read(self, state: _PeerState, publish: Publish) -> None:
        """One stream from `state.peer`, until it ends."""
        state.clock_offset_s = await peer_offset(self.node, state.peer)
        request = Subscribe(maxlen=self.config.maxlen)
        async with self.node.open_stream(state.peer, request, timeout=math.inf) as items:
            state.connected, state.connects = True, state.connects + 1
            log.info("subscribed to the events of %s", state.peer)
            async for item in items:
                self._deliver(state, item, publish)
        state.last_error = "stream ended"

    def _deliver(self, state: _PeerState, item: msgspec.Struct, publish: Publish) -> None:
        if not isinstance(item, EVENT_TYPES):
            state.rejected += 1
            state.last_error = f"sent a {type(item).__name__}, not an event"
            return
        if shift := state.clock_offset_s + self._wall_offset:
            item = msgspec.structs.replace(item, ts=item.ts + shift)
        try:
            publish(cast(AnyEvent, item))  # EVENT_TYPES are AnyEvent's members
        except (ValueError, TypeError, KeyError) as exc:
            # One malformed event (say, a kvflow naming no known request) must not end the
            # peer's stream, nor the dashboard: it is counted, logged and skipped.
            state.rejected += 1
            state.last_error = f"event refused: {exc!r}"
            log.warning("event from %s refused by the dashboard: %r", state.peer, exc)
            return
        state.events += 1

    def last_error(self, peer: str) -> str:
        """What last went wrong with `peer`'s stream ("" if nothing has)."""
        if peer not in self._peers:
            raise ConfigError(f"peer must be one of {sorted(self._peers)}, got {peer!r}")
        return self._peers[peer].last_error

    def statistics(self) -> MeshFeedStatistics:
        peers = tuple(state.freeze() for state in self._peers.values())
        return MeshFeedStatistics(peers=peers, connected=sum(p.connected for p in peers),
                                  events=sum(p.events for p in peers),
                                  failures=sum(p.failures for p in peers),
                                  rejected=sum(p.rejected for p in peers))


def link_control_url(topology: Topology) -> str | None:
    """The first link service's control API (the PrfaaS egress link), if any."""
    for spec in topology.find(kind="link"):
        return f"http://{spec.host}:{spec.options.get('control_port', 8474)}"
    return None


def router_http_url(topology: Topology) -> str | None:
    """The router's HTTP base URL (OpenAI and admin API), if the topology has a router."""
    for spec in topology.find(kind="router"):
        host = http_dial_host(spec)
        return f"http://{host}:{spec.options.get('http_port', 8000)}"
    return None


def dashboard_config(topology: Topology) -> DashboardConfig:
    """PrfaaS clusters by kind (falling back to the name "prfaas" when none says so), every
    link with its ends, and the router's token scale (its option `scale`, else its default)."""
    prfaas = tuple(c.name for c in topology.clusters if c.kind == "prfaas")
    links = tuple((link.name, link.a, link.b) for link in topology.links)
    scale = DEFAULT_TOKEN_SCALE
    for spec in topology.find(kind="router"):
        scale = float(spec.options.get("scale", scale))
    return DashboardConfig(prfaas_clusters=prfaas or ("prfaas",), links=links, token_scale=scale)


async def run_ui(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The `ui` runner: the dashboard fed by the mesh on options.http_host (else the bind
    host) at options.http_port, the feed's statistics at options.metrics_port (0: none; the
    page's own are at /metrics).

    Its node listens on the service's mesh port too (nothing calls it yet; it makes the
    dashboard a member of the mesh like every service, reported in the ready line).
    """
    topology = ctx.topology
    # Direct addresses: the dashboard reads every service, never through a link's proxy.
    node = ctx.node(resolve=topology.address)
    token = token_from_env()
    feed = MeshFeed(node, event_peers(topology))
    controls = HttpControlClient.connect(
        link_control_url(topology), router_http_url(topology),
        supervisor_url=os.environ.get(SUPERVISOR_URL_ENV) or None, token=token)
    host, port = http_bind_host(ctx.spec), ctx.option("http_port", 8080)
    async with node, anyio.create_task_group() as tasks:
        address = await node.listen()
        http_host, http_port = await tasks.start(partial(
            serve_ui, host, port, feed, controls, config=dashboard_config(topology),
            admin_token=token, names=(ctx.spec.host,)))
        # Logged, not announced: stdout carries the ready line alone, which launchers read.
        log.info("dashboard: http://%s:%d/", http_host, http_port)
        sources: dict[str, StatisticsSource] = {"ui_feed": feed.statistics}
        tasks.start_soon(serve_metrics, ctx, sources)
        task_status.started(address)
