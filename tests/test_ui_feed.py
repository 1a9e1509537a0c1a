"""ui/feed.py: the dashboard's feed of every service's events, and the `ui` runner.

The feed tests run peers and the feed in one trio loop over an in-memory network on virtual
time: events of several peers merge, a peer that is late, restarts, or misbehaves costs only
its own stream. The runner test serves the dashboard over real HTTP, fed by an in-process
link service, and moves the link's bandwidth through the dashboard's control.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import trio

from mesh.errors import ConfigError
from mesh.events import EventBus
from mesh.node import Node
from mesh.server import Context
from mesh.topology import parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport
from mesh.wire import Codec
from services.cli.launch import in_process
from services.cli.serve import default_topology, runner_for, serve_main
from services.contract.events import (
    AnyEvent,
    Event,
    KVFlow,
    RequestDone,
    RequestPhase,
    WorkerStatus,
)
from services.contract.messages import (
    CODEC_MESSAGES,
    ClockQuery,
    ClockReading,
    Echo,
    Subscribe,
)
from services.contract.prefix import block_hashes
from services.contract.sampling import Sampling
from services.contract.types import Phase
from services.model.config import family_config, kv_bytes
from services.router.config import SchedulerConfig
from services.router.policies import create_policy
from services.router.requests import GenerationRequest
from services.router.scheduler import Scheduler
from services.router.workers import WorkerTable
from services.service import serve_events
from services.worker.engine import expected_kv_bytes
from tests.ports import free_ports
from tests.test_prefix_transfer import IdTokenizer
from tests.topologies import mesh_toml
from ui.config import DashboardConfig
from ui.feed import (
    FeedConfig,
    MeshFeed,
    dashboard_config,
    event_peers,
    link_control_url,
    router_http_url,
    run_ui,
)
from ui.state import DashboardState

ADDRESSES = {name: Address(name, 1) for name in ("a", "b", "c", "dash")}
FAST = FeedConfig(retry_min_s=0.1, retry_max_s=0.8, wall_clock=False)


def status(worker: str, ts: float) -> WorkerStatus:
    return WorkerStatus(ts=ts, source=worker, worker=worker, cluster="pd", role="prefill",
                        queue_depth=0, running=0, busy=False, cached_blocks=0)


def node(hub: MemoryHub, name: str) -> Node:
    return Node(name, Codec(CODEC_MESSAGES), MemoryTransport(hub), ADDRESSES)


class Peer:
    """A service as the feed sees one: a node serving its bus's events at its address; its
    event clock reads `clock_offset_s` ahead of the test's (another machine's clock)."""

    def __init__(self, hub: MemoryHub, name: str, clock_offset_s: float = 0.0) -> None:
        self.hub, self.name = hub, name
        self.bus: EventBus[Event] = EventBus()
        self.clock_offset_s = clock_offset_s

    def now(self) -> float:
        return trio.current_time() + self.clock_offset_s

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        peer = node(self.hub, self.name)
        serve_events(peer, self.bus, clock=self.now)
        async with peer:
            await peer.listen()
            task_status.started()
            await anyio.sleep_forever()

    async def subscribed(self) -> None:
        """Returns once the feed's subscription is open (events published before are lost)."""
        while self.bus.statistics().subscribers == 0:
            await trio.sleep(0.05)


class Collector:
    def __init__(self, refuse: Callable[[AnyEvent], bool] = lambda event: False) -> None:
        self.events: list[AnyEvent] = []
        self._refuse = refuse

    def publish(self, event: AnyEvent) -> None:
        if self._refuse(event):
            raise ValueError(f"refused {event.source}")
        self.events.append(event)

    async def wait_for(self, count: int) -> None:
        while len(self.events) < count:
            await trio.sleep(0.05)


async def start(group: anyio.abc.TaskGroup, *peers: Peer) -> list[anyio.CancelScope]:
    """Starts each peer in its own cancel scope (cancel one to stop that peer)."""
    scopes = []
    for peer in peers:
        scope = anyio.CancelScope()
        scopes.append(scope)

        async def run(peer: Peer = peer, scope: anyio.CancelScope = scope, *,
                      task_status: anyio.abc.TaskStatus[None]) -> None:
            with scope:
                await peer.serve(task_status=task_status)

        await group.start(run)
    return scopes


async def feed_running(group: anyio.abc.TaskGroup, hub: MemoryHub, peers: list[str],
                       collector: Collector, config: FeedConfig = FAST) -> MeshFeed:
    dash = node(hub, "dash")
    feed = MeshFeed(dash, peers, config)

    async def run() -> None:
        async with dash:
            await feed.run(collector.publish)

    group.start_soon(run)
    return feed


@pytest.mark.trio
async def test_events_of_every_peer_are_merged(autojump_clock: trio.abc.Clock) -> None:
    hub, collector = MemoryHub(), Collector()
    a, b = Peer(hub, "a"), Peer(hub, "b")
    async with anyio.create_task_group() as group:
        await start(group, a, b)
        feed = await feed_running(group, hub, ["a", "b"], collector)
        with trio.fail_after(10):
            await a.subscribed()
            await b.subscribed()
            for i in range(5):
                a.bus.publish(status("a", i))
                b.bus.publish(status("b", i))
            await collector.wait_for(10)
        stats = feed.statistics()
        group.cancel_scope.cancel()
    by_source = {s: [e.ts for e in collector.events if e.source == s] for s in ("a", "b")}
    assert by_source == {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2, 3, 4]}  # each in its order
    assert (stats.connected, stats.events, stats.failures, stats.rejected) == (2, 10, 0, 0)
    assert [(p.peer, p.connects, p.events) for p in stats.peers] == [("a", 1, 5), ("b", 1, 5)]


async def restart(group: anyio.abc.TaskGroup, feed: MeshFeed, scope: anyio.CancelScope,
                  peer: Peer) -> tuple[Peer, float]:
    """Stops `peer` (its node closes every connection) and starts it again as a new process
    would, bus and all; the new peer, and how long the feed took to subscribe to it."""
    scope.cancel()
    index = [p.peer for p in feed.statistics().peers].index(peer.name)
    while feed.statistics().peers[index].connected:
        await trio.sleep(0.01)
    down = trio.current_time()
    again = Peer(peer.hub, peer.name)
    await start(group, again)
    await again.subscribed()
    return again, trio.current_time() - down


@pytest.mark.trio
async def test_a_late_and_a_restarting_peer_are_followed_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    hub, collector = MemoryHub(), Collector()
    a, late = Peer(hub, "a"), Peer(hub, "b")
    async with anyio.create_task_group() as group:
        (scope_a,) = await start(group, a)
        feed = await feed_running(group, hub, ["a", "b"], collector)
        with trio.fail_after(30):
            await a.subscribed()
            await trio.sleep(3)  # b is not up: its attempts fail and back off
            late_stats = feed.statistics().peers[1]
            assert not late_stats.connected
            assert "cannot connect" in feed.last_error("b")
            # Attempts at 0, 0.1, 0.3, 0.7, 1.5, 2.3 s: doubling from retry_min_s to retry_max_s.
            assert 5 <= late_stats.failures <= 7
            (scope_b,) = await start(group, late)
            await late.subscribed()
            late.bus.publish(status("b", 1))
            await collector.wait_for(1)

            a, _ = await restart(group, feed, scope_a, a)
            a.bus.publish(status("a", 2))
            await collector.wait_for(2)
            # b's stream lived longer than the longest backoff: a restart is followed at once,
            # not after the retry_max_s its failures had grown the backoff to.
            await trio.sleep(1)
            late, took = await restart(group, feed, scope_b, late)
            assert took <= FAST.retry_min_s + 0.05
            late.bus.publish(status("b", 3))
            await collector.wait_for(3)
        first, second = feed.statistics().peers
        group.cancel_scope.cancel()
    assert [(e.source, e.ts) for e in collector.events] == [("b", 1), ("a", 2), ("b", 3)]
    assert (first.connects, second.connects) == (2, 2)
    assert first.failures >= 1 and second.connected and first.connected


class Stray(Peer):
    """A peer whose event stream carries something that is not an event, then an event."""

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        peer = node(self.hub, self.name)

        @peer.handles(ClockQuery)
        async def on_clock(msg: ClockQuery, ctx: Context) -> ClockReading:
            return ClockReading(now=trio.current_time())

        @peer.serves_stream(Subscribe)
        async def on_subscribe(msg: Subscribe, ctx: Context) -> Any:
            yield Echo(text="not an event")
            yield status(self.name, 7)
            await anyio.sleep_forever()

        async with peer:
            await peer.listen()
            task_status.started()
            await anyio.sleep_forever()


class Deaf(Peer):
    """A peer that listens but serves no event stream: every ClockQuery (the first thing the
    feed asks) fails."""

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with node(self.hub, self.name) as peer:
            await peer.listen()
            task_status.started()
            await anyio.sleep_forever()


@pytest.mark.trio
async def test_bad_peers_and_refused_events_cost_only_themselves(
    autojump_clock: trio.abc.Clock,
) -> None:
    hub = MemoryHub()
    collector = Collector(refuse=lambda event: event.ts < 0)
    good, stray, deaf = Peer(hub, "a"), Stray(hub, "b"), Deaf(hub, "c")
    async with anyio.create_task_group() as group:
        await start(group, good, stray, deaf)
        feed = await feed_running(group, hub, ["a", "b", "c"], collector)
        with trio.fail_after(30):
            await good.subscribed()
            good.bus.publish(status("a", -1))  # the dashboard refuses this one
            good.bus.publish(status("a", 1))
            await collector.wait_for(2)
            await trio.sleep(5)  # the deaf peer keeps failing meanwhile
        a, b, c = feed.statistics().peers
        errors = {peer: feed.last_error(peer) for peer in "abc"}
        group.cancel_scope.cancel()
    assert sorted((e.source, e.ts) for e in collector.events) == [("a", 1), ("b", 7)]
    assert (a.events, a.rejected, a.connected) == (1, 1, True)
    assert "event refused" in errors["a"]
    assert (b.events, b.rejected, b.connected) == (1, 1, True)
    assert "Echo" in errors["b"]
    # Each attempt fails at its first question (the clock); the retries back off all the same.
    assert (c.events, c.connected, c.connects) == (0, False, 0)
    assert 5 <= c.failures <= 5 / FAST.retry_max_s + 4 and "ClockQuery" in errors["c"]


@pytest.mark.trio
async def test_timelines_line_up_across_machines_whose_clocks_differ(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The router, a prefill and a decode worker on three machines, their clocks hours apart:
    the dashboard's timeline of one request still shows each phase's true length, and the
    router's TTFT (one clock) is what it measured."""
    hub, collector = MemoryHub(), Collector()
    router, prefill, decode = Peer(hub, "a"), Peer(hub, "b", 5000.0), Peer(hub, "c", -3600.0)
    state = DashboardState(DashboardConfig())
    async with anyio.create_task_group() as group:
        await start(group, router, prefill, decode)
        feed = await feed_running(group, hub, ["a", "b", "c"], collector)
        with trio.fail_after(30):
            for peer in (router, prefill, decode):
                await peer.subscribed()
            queued = router.now()
            router.bus.publish(phase(router, "queued", queued))
            await trio.sleep(0.25)
            prefill.bus.publish(phase(prefill, "prefill", prefill.now()))
            await trio.sleep(0.5)
            decode.bus.publish(phase(decode, "decode", decode.now()))
            await trio.sleep(1.0)
            router.bus.publish(done(router, ttft_s=0.75, ts=router.now()))
            await collector.wait_for(4)
        offsets = [p.clock_offset_s for p in feed.statistics().peers]
        group.cancel_scope.cancel()
    for event in collector.events:
        state.apply(event)
    view = state.request("req-1")
    assert view is not None and view.done is not None
    times = {p.phase: p.ts for p in view.phases}
    assert times["prefill"] - times["queued"] == pytest.approx(0.25, abs=1e-6)
    assert times["decode"] - times["prefill"] == pytest.approx(0.5, abs=1e-6)
    assert view.done.ts - times["queued"] == pytest.approx(1.75, abs=1e-6)
    assert view.done.ttft_s == 0.75
    assert offsets == pytest.approx([0.0, -5000.0, 3600.0])


def phase(peer: Peer, name: Phase, ts: float) -> RequestPhase:
    return RequestPhase(ts=ts, source=peer.name, request_id="req-1", phase=name,
                        worker=peer.name)


def done(peer: Peer, *, ttft_s: float, ts: float) -> RequestDone:
    return RequestDone(ts=ts, source=peer.name, request_id="req-1", cluster="pd",
                       ttft_s=ttft_s, tpot_s=0.01, e2e_s=1.75, prompt_tokens=10,
                       output_tokens=8, cached_tokens=0, ok=True)


def test_config_errors_name_the_parameter() -> None:
    with pytest.raises(ConfigError, match=r"maxlen must be 1\.\.65536, got 0"):
        FeedConfig(maxlen=0)
    with pytest.raises(ConfigError, match=r"retry_min_s <= retry_max_s, got 2\.0 and 1\.0"):
        FeedConfig(retry_min_s=2.0, retry_max_s=1.0)
    with pytest.raises(ConfigError, match="at least one peer"):
        MeshFeed(node(MemoryHub(), "dash"), [])
    with pytest.raises(ConfigError, match="peer must be one of \\['a'\\], got 'z'"):
        MeshFeed(node(MemoryHub(), "dash"), ["a"]).last_error("z")


def test_the_default_topology_feeds_the_dashboard_from_every_publishing_service() -> None:
    topology = default_topology()
    assert event_peers(topology) == ["router", "cachedir", "prfaas-prefill-0", "pd-prefill-0",
                                     "pd-decode-0", "pd-prefill-1", "pd-decode-1", "link-0"]
    assert link_control_url(topology) == "http://127.0.0.1:8474"
    assert router_http_url(topology) == "http://127.0.0.1:8000"
    assert dashboard_config(topology).prfaas_clusters == ("prfaas",)
    bare = parse_topology('[[services]]\nname = "ui"\nkind = "ui"\nport = 7150\n')
    assert (link_control_url(bare), router_http_url(bare), event_peers(bare)) == (None, None, [])




async def poll(client: httpx.AsyncClient, path: str, done: Callable[[Any], bool]) -> Any:
    while True:
        body = (await client.get(path)).json()
        if done(body):
            return body
        await trio.sleep(0.1)


@pytest.fixture
async def dashboard_with_a_link() -> AsyncIterator[tuple[httpx.AsyncClient, str, str]]:
    """`ui` and `link` runners in this loop: the mesh in memory, their HTTP on real ports."""
    ui_port, control, proxy, metrics = free_ports(4)
    topology = parse_topology(f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
[[clusters]]
name = "pd"
[[services]]
name = "d"
kind = "decode"
cluster = "pd"
port = 1
[[services]]
name = "link-0"
kind = "link"
port = 2
options = {{ control_port = {control}, proxy_base_port = {proxy}, stats_interval = 0.2 }}
[[services]]
name = "ui"
kind = "ui"
port = 3
options = {{ http_port = {ui_port}, metrics_port = {metrics} }}
[[links]]
name = "link-0"
a = "prfaas"
b = "pd"
bandwidth_bps = 1e9
""")
    # The decode worker never starts: the dashboard must go on without it.
    async with in_process(topology, ["link-0", "ui"]), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{ui_port}", timeout=5) as client:
        yield client, f"http://127.0.0.1:{control}", f"http://127.0.0.1:{metrics}/metrics"


@pytest.mark.trio
async def test_the_ui_runner_shows_the_link_and_moves_its_bandwidth(
    dashboard_with_a_link: tuple[httpx.AsyncClient, str, str],
) -> None:
    client, link_url, metrics_url = dashboard_with_a_link
    with trio.fail_after(60):
        snapshot = await poll(client, "/api/snapshot", lambda s: len(s["links"]) == 1)
        assert snapshot["mode"] == "live"
        assert snapshot["links"][0]["bandwidth_bps"] == 1e9
        # The page hands its CSRF token to its scripts; POSTs send it back (ui/guard.py).
        client.headers["x-csrf-token"] = await csrf_token(client)
        answer = await client.post("/api/control/link", json={"bandwidth_bps": 2e9})
        assert answer.status_code == 200 and answer.json()["bandwidth_bps"] == 2e9
        await poll(client, "/api/snapshot", lambda s: s["links"][0]["bandwidth_bps"] == 2e9)
        async with httpx.AsyncClient() as direct:
            assert (await direct.get(f"{link_url}/link")).json()["bandwidth_bps"] == 2e9
            # The feed's statistics: the link's stream is up, the absent worker's is not.
            text = (await direct.get(metrics_url)).text
        assert 'prfaas_ui_feed_peers_connected{peer="link-0",service="ui"} 1.0' in text
        assert 'prfaas_ui_feed_peers_connected{peer="d",service="ui"} 0.0' in text
        assert 'prfaas_ui_feed_peers_failures_total{peer="d",service="ui"}' in text
        # No router in this topology: its controls answer 503, naming it.
        refused = await client.post("/api/control/workload", json={"action": "start"})
        assert refused.status_code == 503 and "router" in refused.json()["error"]


def test_snapshot_mode_says_simulated_for_the_simulation() -> None:
    from ui.config import DashboardConfig
    from ui.hub import EventHub

    assert EventHub(DashboardConfig()).snapshot().mode == "live"
    hub = EventHub(DashboardConfig(live_mode="simulated"))
    assert hub.snapshot().mode == "simulated"
    hub.reset("replay")
    assert msgspec.to_builtins(hub.snapshot())["mode"] == "replay"


def test_prfaas_serve_runs_the_mesh_dashboard_and_has_no_synthetic_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert runner_for("ui") is run_ui
    # The synthetic demo is gone: the simulation's dashboard is `prfaas sim-dashboard`.
    with pytest.raises(SystemExit):
        serve_main(["ui", "--simulated"])
    assert "unrecognized arguments: --simulated" in capsys.readouterr().err


@pytest.mark.trio
async def test_monotonic_stamps_become_wall_time(autojump_clock: trio.abc.Clock) -> None:
    hub, collector = MemoryHub(), Collector()
    peer = Peer(hub, "a")
    async with anyio.create_task_group() as group:
        await start(group, peer)
        await feed_running(group, hub, ["a"], collector, FeedConfig(wall_clock=True))
        with trio.fail_after(10):
            await peer.subscribed()
            stamped_at = time.monotonic()
            peer.bus.publish(status("a", stamped_at))
            await collector.wait_for(1)
        group.cancel_scope.cancel()
    # The event says when it happened as a time of day, whatever the service's clock.
    assert abs(collector.events[0].ts - time.time()) < 5.0
    assert collector.events[0].ts > stamped_at + 1e6


async def csrf_token(client: httpx.AsyncClient) -> str:
    page = (await client.get("/")).text
    found = re.search(r'<meta name="csrf-token" content="([^"]+)">', page)
    assert found is not None
    return found.group(1)


# A real mesh: the dashboard's feed subscribed to real workers (issue 14.5).

KV_TOKENS = 8  # answer length of each turn
KV_DTYPE = "float32"  # pinned: "auto" depends on the machine


def kv_topology() -> Any:
    """A PrfaaS prefill, a PD prefill and a PD decode worker of the tiny kimi-linear model, the
    cache directory and the link, on free ports (as tests/test_prefix_transfer.py's)."""
    cachedir, link, control, proxy, p, q, d = free_ports(7)
    worker = ('family = "kimi-linear", size = "tiny", checkpoint = "none", threads = 1, '
              f'connections = 2, dtype = "{KV_DTYPE}"')
    return parse_topology(mesh_toml(
        {"cachedir": cachedir, "p": p, "q": q, "d": d, "link": link}, worker=worker,
        options={"link": f"control_port = {control}, proxy_base_port = {proxy}"}, link_bps=1e9))


class KvCollector(Collector):
    def flows(self, request_id: str) -> list[KVFlow]:
        return [e for e in self.events if isinstance(e, KVFlow) and e.request_id == request_id]


async def until_done(collector: KvCollector, request_id: str) -> KVFlow:
    while not any(f.phase == "done" for f in collector.flows(request_id)):
        await trio.sleep(0.05)
    return next(f for f in collector.flows(request_id) if f.phase == "done")


@pytest.mark.slow
@pytest.mark.trio
async def test_real_workers_kv_flows_reach_the_feed_with_their_true_size() -> None:
    """The feed on a real mesh: an offloaded first turn's KV crosses the link in full (S_kv of
    its length, from the model's kv size function); the second turn, whose prefix the decode
    worker already holds, sends only the new tokens' KV (incremental)."""
    topo = kv_topology()
    cfg = family_config("kimi-linear", "tiny")
    first = [(i * 7) % 500 + 1 for i in range(200)]
    second = first + [(i * 11) % 500 + 3 for i in range(140)]
    sampling = Sampling(max_tokens=KV_TOKENS, stop_on_eos=False)
    collector = KvCollector()
    names = ["cachedir", "link", "p", "q", "d"]
    async with in_process(topo, names, transport=TcpTransport(), via_links=True) as mesh, \
            mesh.client("router") as router, mesh.client("dash") as dash, \
            anyio.create_task_group() as group:
        feed = MeshFeed(dash, event_peers(topo), FeedConfig(wall_clock=False))
        group.start_soon(feed.run, collector.publish)
        policy = create_policy("prfaas", {"threshold": 100.0, "prefix_rule": "scarce"})
        scheduler = Scheduler(router, policy, WorkerTable.from_topology(topo), IdTokenizer(),
                              SchedulerConfig(block_size=cfg.block_size, connections=2))
        await group.start(scheduler.run)
        with trio.fail_after(120):
            while feed.statistics().connected < len(names):
                await trio.sleep(0.05)
            one = await scheduler.submit(GenerationRequest(prompt=first, sampling=sampling))
            await one.collect()
            full = await until_done(collector, one.placement.request_id)
            while not scheduler.workers.held_blocks("d", await lookup(scheduler, second)):
                await trio.sleep(0.05)  # d's cache report reaches the directory (a cast)
            two = await scheduler.submit(GenerationRequest(prompt=second, sampling=sampling))
            await two.collect()
            incremental = await until_done(collector, two.placement.request_id)
        group.cancel_scope.cancel()
    dtype = KV_DTYPE
    assert (full.src, full.dst, full.via_link, full.incremental) == ("p", "d", "link", False)
    assert one.placement.cluster == "prfaas" and one.placement.decode_has_tokens == 0
    assert full.bytes_total == kv_bytes(cfg, len(first), dtype)  # S_kv(200)
    assert full.tokens_sent == len(first) and full.layers_done == full.layers_total
    held = two.placement.decode_has_tokens
    assert held == 192 and two.placement.cluster == "prfaas"
    assert (incremental.via_link, incremental.incremental) == ("link", True)
    # Only the new tokens' KV and the fixed-size states: S_kv(340) - per-token KV of 192.
    assert incremental.bytes_total == expected_kv_bytes(cfg, len(second), held, dtype)
    assert incremental.bytes_total < kv_bytes(cfg, len(second), dtype)
    assert incremental.tokens_sent == len(second) - held
    # What went out is that payload plus the pieces' headers.
    for flow in (full, incremental):
        assert flow.bytes_total <= flow.bytes_done <= 1.05 * flow.bytes_total


async def lookup(scheduler: Scheduler, prompt: list[int]) -> Any:
    return await scheduler.placer._lookup(block_hashes(prompt, scheduler.config.block_size))
