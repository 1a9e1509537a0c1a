"""The dashboard without a browser: series, state, hub, SSE, replay, controls, the app - fed by
the simulation (services/sim: the live services over an in-memory network, virtual time)."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from ui_fixtures.sim import SMALL, SMALL_WORKERS, conversations, paced_client, sim_events

from mesh.errors import ConfigError
from mesh.topology import load_topology
from services.cli.procfile import ProcessSpec
from services.cli.supervisor import RestartPolicy, Supervisor
from services.cli.supervisor_api import supervisor_app
from services.contract import events as t
from services.contract.access import bearer_headers
from services.contract.events import write_event_log
from services.router.policies import POLICIES
from services.sim.clock import PacedClock
from services.sim.controls import SimControls
from services.sim.live import LiveConfig, LiveSim
from services.sim.record import record_events, record_virtual
from services.sim.world import Deployment
from tests.dashboard_events import (
    decision,
    done,
    flow,
    link,
    role_changed,
    threshold_changed,
    worker,
)
from ui.app import build_app
from ui.config import DashboardConfig
from ui.controls import (
    HttpControlClient,
    LinkUpdate,
    PolicyRequest,
    RoleRequest,
    SpeedRequest,
    ThresholdRequest,
    WorkloadRequest,
)
from ui.errors import ControlError, ReplayError, UiConfigError
from ui.feed import dashboard_config
from ui.guard import AccessGuard
from ui.hub import EventHub, FeedBatch, NoSource
from ui.replay import PACKAGED_REPLAYS, ReplayControl, read_log, run_replay
from ui.series import MAX_GAP_POINTS, SeriesAggregator, SeriesPoint, percentile
from ui.serve import serve_ui
from ui.sse import encode_batch, event_stream
from ui.state import DashboardState, RequestView, Snapshot

UI = Path(__file__).resolve().parent.parent / "ui"
TOPOLOGIES = UI.parent / "services" / "cli" / "topologies"


# Series: percentile and the windowed aggregator, each against a slow reference.


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_percentile_rejects_empty_and_bad_q() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be within 0\.\.100, got 101"):
        percentile([1.0], 101)


def reference_point(events: list[t.AnyEvent], end: float, config: DashboardConfig) -> SeriesPoint:
    """The point at `end` recomputed from every event seen so far (the slow, obvious way)."""
    start = end - config.window_s
    seen = [e for e in events if e.ts < end]
    dones = [e for e in seen if isinstance(e, t.RequestDone) and e.ok and e.ts > start]
    decisions = [e for e in seen if isinstance(e, t.RoutingDecision) and e.ts > start]
    latest: dict[str, t.LinkStats] = {}
    threshold = None
    for e in seen:
        if isinstance(e, t.LinkStats):
            latest[e.link] = e
        if isinstance(e, t.RoutingDecision):
            threshold = e.threshold
        if isinstance(e, t.ThresholdChanged):
            threshold = e.new
    fresh = [s for s in latest.values() if s.ts > start]
    ttfts = [d.ttft_s for d in dones]
    prompt = sum(d.prompt_tokens for d in dones)
    span = max(min(config.window_s, end - events[0].ts), config.bucket_s)
    return SeriesPoint(
        ts=end,
        ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts else None,
        ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts else None,
        throughput_rps=len(dones) / span,
        egress_gbps=sum(s.throughput_bps for s in fresh) / 1e9,
        bandwidth_gbps=sum(s.bandwidth_bps for s in fresh) / 1e9,
        threshold=threshold,
        offload=(sum(d.cluster == "prfaas" for d in decisions) / len(decisions))
        if decisions
        else None,
        cache_hit=sum(d.cached_tokens for d in dones) / prompt if prompt else None,
    )


def assert_points_equal(got: SeriesPoint, want: SeriesPoint) -> None:
    for field in got.__struct_fields__:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), (field, a, b)
        if a is not None:
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (field, a, b)


def test_series_points_match_the_reference_on_the_simulation() -> None:
    config = DashboardConfig(bucket_s=1.0, window_s=5.0)
    events = list(sim_events(40.0))
    aggregator = SeriesAggregator(config)
    points: list[SeriesPoint] = []
    for event in events:
        points += aggregator.observe(event)
    # A point a second: the samples of second 39 close the bucket ending there.
    assert [p.ts for p in points] == [float(i) for i in range(1, 40)]
    for point in points:
        assert_points_equal(point, reference_point(events, point.ts, config))
    assert any(p.ttft_p50_s for p in points) and any(p.cache_hit for p in points)


def test_series_values_by_hand() -> None:
    config = DashboardConfig(bucket_s=1.0, window_s=10.0)
    agg = SeriesAggregator(config)
    stream: list[t.AnyEvent] = [
        decision(0.1, "a", "prfaas"),
        decision(0.2, "b", "pd"),
        decision(0.3, "c", "pd"),
        decision(0.4, "d", "prfaas"),
        link(0.5, 4e9),
        done(0.6, 1.0, prompt=1000, cached=250),
        done(0.7, 3.0, prompt=1000, cached=750),
    ]
    for event in stream:
        assert agg.observe(event) == []
    [point] = agg.observe(link(1.0, 2e9))
    assert point.ts == 1.0 and point.offload == 0.5 and point.cache_hit == 0.5
    assert point.ttft_p50_s == pytest.approx(2.0) and point.ttft_p90_s == pytest.approx(2.8)
    assert point.egress_gbps == pytest.approx(4.0) and point.bandwidth_gbps == pytest.approx(10.0)
    assert point.throughput_rps == pytest.approx(2 / 1.0)  # one bucket of history so far
    # Eleven seconds later everything has left the window and the link sample is stale.
    points = agg.observe(link(12.5, 1e9))
    assert [p.ts for p in points] == [float(s) for s in range(2, 13)]
    last = points[-1]
    assert last.ttft_p50_s is None and last.offload is None and last.cache_hit is None
    assert last.egress_gbps == 0 and last.throughput_rps == 0 and last.threshold == 19400.0


def test_series_bridges_long_idle_gaps_with_a_bounded_number_of_points() -> None:
    agg = SeriesAggregator(DashboardConfig())
    agg.observe(link(0.0, 1e9))
    points = agg.observe(link(5000.0, 1e9))
    assert len(points) == MAX_GAP_POINTS
    assert [p.ts for p in agg.observe(link(5001.0, 1e9))] == [5001.0]


# State and snapshot.


def test_state_keeps_every_bound_and_tracks_flows_roles_and_requests() -> None:
    config = DashboardConfig(max_decisions=5, max_flows=3, max_timelines=4)
    state = DashboardState(config)
    for i in range(10):
        state.apply(decision(float(i), f"r{i}"))
        state.apply(flow(i + 0.1, f"r{i}", "start"))
        state.apply(
            t.RequestPhase(ts=i + 0.2, source="w", request_id=f"r{i}", phase="queued", worker="w")
        )
        state.check_integrity()
    assert [d.request_id for d in state.decisions] == [f"r{i}" for i in range(5, 10)]
    assert list(state.flows) == ["r7", "r8", "r9"]
    assert list(state.requests) == ["r6", "r7", "r8", "r9"]
    state.apply(flow(11.0, "r9", "done", 8))
    assert "r9" not in state.flows and state.request("r9").flow.phase == "done"  # type: ignore[union-attr]
    assert state.request("r0") is None
    state.apply(worker(12.0))
    state.apply(role_changed(13.0, "pd-prefill-0", "prefill", "draining"))
    assert state.workers["pd-prefill-0"].role == "draining"
    state.apply(threshold_changed(14.0, 19400.0, None))
    assert state.threshold is None
    stats = state.statistics()
    assert (stats.decisions, stats.flows, stats.requests, stats.workers) == (5, 2, 4, 1)
    state.check_integrity()


def test_a_migrated_request_is_one_timeline_with_its_break_marked() -> None:
    state = DashboardState(DashboardConfig())
    state.apply(decision(0.0, "r1"))
    for ts, rid, phase, worker_name in ((0.1, "r1", "decode", "pd-decode-0"),
                                        (0.6, "r1.m1", "prefill", "pd-prefill-0"),
                                        (0.9, "r1.m1", "decode", "pd-decode-1")):
        state.apply(t.RequestPhase(ts=ts, source=worker_name, request_id=rid, phase=phase,
                                   worker=worker_name))
    state.apply(t.RequestMigrated(
        ts=0.5, source="router", request_id="r1", attempt=1, reason="decode_lost",
        failed_worker="pd-decode-0", prefill_worker="pd-prefill-0",
        decode_worker="pd-decode-1", cluster="pd", tokens_kept=7))
    state.apply(flow(0.7, "r1.m1", "start"))
    state.check_integrity()
    view = state.request("r1")
    assert view is not None and state.request("r1.m1") is None
    assert [(p.ts, p.phase) for p in view.phases] == [(0.1, "decode"), (0.6, "prefill"),
                                                       (0.9, "decode")]
    assert [(m.reason, m.decode_worker, m.tokens_kept) for m in view.migrations] == [
        ("decode_lost", "pd-decode-1", 7)]
    assert view.flow is not None and view.flow.request_id == "r1.m1"
    assert msgspec.json.decode(msgspec.json.encode(view), type=RequestView) == view


def test_snapshot_and_request_view_round_trip_through_json() -> None:
    state = DashboardState(DashboardConfig())
    for event in sim_events(10.0):
        state.apply(event)
    snapshot = state.snapshot(42, "live")
    again = msgspec.json.decode(msgspec.json.encode(snapshot), type=Snapshot)
    assert again == snapshot and again.seq == 42 and snapshot.workers and snapshot.series
    rid = snapshot.decisions[0].request_id
    view = state.request(rid)
    assert view is not None and view.decision is not None and view.phases
    assert msgspec.json.decode(msgspec.json.encode(view), type=RequestView) == view


def test_config_errors_name_the_parameter() -> None:
    with pytest.raises(UiConfigError, match="client_buffer must be > 0, got 0"):
        DashboardConfig(client_buffer=0)
    with pytest.raises(UiConfigError, match=r"window_s must be >= bucket_s=2\.0, got 1\.0"):
        DashboardConfig(bucket_s=2.0, window_s=1.0)


# The hub and its feeds.


def test_hub_fans_out_numbered_events_and_drops_the_oldest_for_a_slow_browser() -> None:
    hub = EventHub(DashboardConfig(client_buffer=3))
    with hub.subscribe() as slow, hub.subscribe() as fast:
        hub.publish(decision(0.5, "a"))
        batch = fast.take(10)
        assert batch is not None and batch.first_seq == 1 and batch.dropped == 0
        assert msgspec.json.decode(batch.events[0])["request_id"] == "a"
        for i in range(4):
            hub.publish(decision(0.6 + i / 10, f"b{i}"))
        hub.check_integrity()
        batch = slow.take(10)
        assert batch is not None and batch.first_seq == 3 and batch.dropped == 2
        assert [msgspec.json.decode(e)["request_id"] for e in batch.events] == ["b1", "b2", "b3"]
        assert slow.take(10) is None
        stats = hub.statistics()
        # The fast browser, not reading after its first event, lost one too.
        assert (stats.published, stats.clients, stats.dropped, stats.seq) == (5, 2, 3, 5)
    stats = hub.statistics()
    assert stats.clients == 0 and stats.dropped == 3 and stats.delivered == 4


def test_hub_emits_chart_points_into_the_feed() -> None:
    hub = EventHub(DashboardConfig())
    with hub.subscribe() as feed:
        hub.publish(link(0.5, 1e9))
        hub.publish(link(1.5, 1e9))
        batch = feed.take(10)
        assert batch is not None
        types = [msgspec.json.decode(e)["type"] for e in batch.events]
        assert types == ["link", "series", "link"] and hub.statistics().points == 1


def test_replay_owns_the_hub_until_it_goes_back_to_live() -> None:
    hub = EventHub(DashboardConfig())
    with hub.subscribe() as feed:
        hub.publish(decision(0.0, "live-1"))
        hub.reset("replay")
        hub.publish(decision(1.0, "live-ignored"))
        hub.publish_replayed(decision(2.0, "replayed"))
        batch = feed.take(10)
        assert batch is not None and batch.reset
        assert [msgspec.json.decode(e)["request_id"] for e in batch.events] == ["replayed"]
        assert [d.request_id for d in hub.snapshot().decisions] == ["replayed"]
        assert hub.snapshot().mode == "replay"
        hub.reset("live")
        hub.publish_replayed(decision(3.0, "late"))
        assert hub.snapshot().decisions == [] and hub.statistics().ignored == 2


def test_sse_batch_encoding() -> None:
    batch = FeedBatch(7, [b'{"a":1}', b'{"b":2}'], 3, True)
    assert encode_batch(batch) == (
        b'event: reset\ndata: {}\n\ndata: {"first":7,"dropped":3,"events":[{"a":1},{"b":2}]}\n\n'
    )
    assert encode_batch(FeedBatch(0, [], 0, False)) == b""


@pytest.mark.trio
async def test_event_stream_says_hello_batches_bursts_beats_and_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = EventHub(DashboardConfig(heartbeat_s=5.0, batch_window_s=0.05))
    hub.publish(decision(0.0, "before"))
    stream = event_stream(hub)
    assert await anext(stream) == b'retry: 2000\n\nevent: hello\ndata: {"seq":1}\n\n'

    async def burst() -> None:
        for i in range(20):
            hub.publish(decision(0.1 + i / 1000, f"r{i}"))
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(burst)
        message = await anext(stream)
    payload = msgspec.json.decode(message.removeprefix(b"data: ").strip())
    assert payload["first"] == 2 and len(payload["events"]) == 20  # one message for the burst
    start = anyio.current_time()
    assert await anext(stream) == b": heartbeat\n\n"
    assert anyio.current_time() - start == pytest.approx(5.0)
    hub.close()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    await stream.aclose()


# Replay.


def test_log_round_trip_and_the_packaged_sample(tmp_path: Path) -> None:
    events = list(sim_events(10.0))
    path = tmp_path / "run.jsonl"
    assert write_event_log(path, events) == len(events)
    assert read_log(path) == events
    sample = PACKAGED_REPLAYS / "sample.jsonl"
    assert sample.stat().st_size < 500_000
    recorded = read_log(sample)
    kinds = {type(e) for e in recorded}
    assert {t.RoutingDecision, t.KVFlow, t.LinkStats, t.WorkerStatus, t.RequestDone} <= kinds
    # Recorded from the simulated paper deployment (prfaas sim-dashboard --record): its
    # workers, its link, minutes of virtual time.
    workers = {e.worker for e in recorded if isinstance(e, t.WorkerStatus)}
    assert len(workers) == 12 and {e.link for e in recorded if isinstance(e, t.LinkStats)} == {
        "link-0"}
    assert recorded[-1].ts - recorded[0].ts >= 100


def test_read_log_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(t.encode_json(link(0.0, 1.0)) + b"\n\n" + b'{"type": "link", "ts": 1}\n')
    with pytest.raises(ReplayError, match=r"bad.jsonl line 3: .*"):
        read_log(path)
    with pytest.raises(ReplayError, match="cannot read event log"):
        read_log(tmp_path / "missing.jsonl")


@pytest.mark.trio
async def test_run_replay_keeps_the_timing_scaled_by_speed_and_pauses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events = [link(100.0, 1e9), link(101.0, 1e9), link(104.0, 1e9)]
    hub = EventHub(DashboardConfig())
    hub.reset("replay")
    seen: list[float] = []
    original = hub.publish_replayed

    def stamp(event: t.AnyEvent) -> None:
        seen.append(anyio.current_time())
        original(event)

    hub.publish_replayed = stamp  # type: ignore[method-assign]
    start = anyio.current_time()
    assert await run_replay(events, hub, speed=2.0) == 3
    assert [s - start for s in seen] == pytest.approx([0.0, 0.5, 2.0])
    control = ReplayControl(1.0)
    control.pause()
    seen.clear()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lambda: run_replay(events, hub, control=control))
        await anyio.sleep(10.0)
        assert len(seen) == 1  # the first event is due at once; then it waits for resume
        start = anyio.current_time()
        control.resume()
    assert [s - start for s in seen[1:]] == pytest.approx([1.0, 4.0])
    with pytest.raises(ReplayError, match=r"speed must be within \(0, 1000\], got 0"):
        ReplayControl(0)


# Controls: the HTTP client against a recorded router and the real link control API.


def recording_router(calls: list[tuple[str, str, Any]], status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        body = msgspec.json.decode(request.content) if request.content else None
        calls.append((request.method, request.url.path, body))
        if status >= 400:
            return httpx.Response(status, json={"error": "no such policy 'x'"})
        return httpx.Response(200, json={"policy": "prfaas", "policies": ["prfaas"], "workers": []})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://router")


@pytest.mark.trio
async def test_http_controls_follow_the_router_contract() -> None:
    calls: list[tuple[str, str, Any]] = []
    client = HttpControlClient(None, recording_router(calls))
    await client.set_policy(PolicyRequest("length"))
    await client.set_threshold(ThresholdRequest(None))
    await client.set_threshold(ThresholdRequest(8192.0))
    await client.workload(WorkloadRequest("start", 3.0))
    await client.set_role("pd-prefill-1", RoleRequest("decode"))
    await client.drain("pd-decode-0")
    assert calls == [
        ("POST", "/admin/policy", {"policy": "length"}),
        ("POST", "/admin/threshold", {"t": None}),
        ("POST", "/admin/threshold", {"t": 8192.0}),
        ("POST", "/admin/workload", {"action": "start", "rate": 3.0, "kind": "mixed"}),
        ("POST", "/admin/workers/pd-prefill-1/role", {"role": "decode"}),
        ("POST", "/admin/workers/pd-decode-0/drain", {}),
    ]
    state = await client.state()
    assert state["router"]["policy"] == "prfaas" and state["link"] is None
    assert "no link is configured" in state["errors"]["link"]
    with pytest.raises(ControlError, match="no link is configured") as info:
        await client.update_link(LinkUpdate(delay_ms=1.0))
    assert info.value.status == 503
    with pytest.raises(ControlError, match="plain name"):
        await client.drain("../admin")
    await client.aclose()


@pytest.mark.trio
async def test_http_controls_translate_upstream_and_transport_errors() -> None:
    rejecting = HttpControlClient(None, recording_router([], status=400))
    with pytest.raises(ControlError, match="router: no such policy 'x'") as info:
        await rejecting.set_policy(PolicyRequest("x"))
    assert info.value.status == 400

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    dead = httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://127.0.0.1:1")
    unreachable = re.escape("link at http://127.0.0.1:1 unreachable")
    with pytest.raises(ControlError, match=unreachable) as info:
        await HttpControlClient(dead, None).update_link(LinkUpdate(up=False))
    assert info.value.status == 502


@pytest.mark.trio
async def test_http_controls_drive_the_real_link_control_api() -> None:
    from netem.control import create_control_app
    from netem.params import LinkParams
    from netem.proxy import LinkProxy, Route
    from netem.shaper import LinkShaper

    shaper = LinkShaper(LinkParams(), anyio.current_time, random.Random(0))
    app = create_control_app(LinkProxy([Route(9001, 9002)], shaper), name="wan")
    transport = httpx.ASGITransport(app=app)
    link_client = httpx.AsyncClient(transport=transport, base_url="http://link")
    client = HttpControlClient(link_client, None)
    answer = await client.update_link(LinkUpdate(bandwidth_bps=2e9, delay_ms=20.0, up=False))
    assert answer["bandwidth_bps"] == 2e9 and answer["up"] is False
    assert shaper.params.bandwidth_bps == 2e9 and shaper.params.delay_s == pytest.approx(0.02)
    assert (await client.state())["link"]["delay_ms"] == pytest.approx(20.0)
    await client.update_link(LinkUpdate(bandwidth_bps=None))
    unshaped = shaper.params
    assert unshaped.bandwidth_bps is None
    with pytest.raises(ControlError, match="a live mesh runs in real time") as info:
        await client.set_speed(SpeedRequest(10.0))
    assert info.value.status == 409
    await client.aclose()


def test_control_requests_round_trip_and_name_bad_fields() -> None:
    for request in (
        LinkUpdate(bandwidth_bps=1e9, up=True),
        PolicyRequest("prfaas"),
        ThresholdRequest(None),
        WorkloadRequest("stop"),
        RoleRequest("prefill"),
    ):
        assert msgspec.json.decode(msgspec.json.encode(request), type=type(request)) == request
    assert msgspec.json.encode(LinkUpdate(loss=0.1)) == b'{"loss":0.1}'
    with pytest.raises(msgspec.ValidationError, match=r"<= 1.0 - at `\$.loss`"):
        msgspec.json.decode(b'{"loss": 2}', type=LinkUpdate)
    with pytest.raises(msgspec.ValidationError, match="unknown field `speed`"):
        msgspec.json.decode(b'{"speed": 2}', type=LinkUpdate)


# The simulation as the dashboard's source: its events and its controls.


def test_simulation_events_are_consistent_and_cover_every_service() -> None:
    events = sim_events(40.0)
    assert list(events) == list(sim_events(40.0))  # deterministic (and cached)
    assert [e.ts for e in events] == sorted(e.ts for e in events)
    for event in events:
        assert t.decode_json(t.encode_json(event)) == event
    decisions = {e.request_id: e for e in events if isinstance(e, t.RoutingDecision)}
    assert len(decisions) >= 20 and {d.cluster for d in decisions.values()} == {"prfaas", "pd"}
    for d in decisions.values():
        assert (d.cluster == "prfaas") == (d.incremental_len > (d.threshold or 0)), d
    finished = [e for e in events if isinstance(e, t.RequestDone)]
    assert finished and all(e.request_id in decisions and e.ok for e in finished)
    assert any(e.cached_tokens for e in finished)  # follow-up turns hit the caches
    # Every service's bus reaches the feed: router, workers, cache directory, link samples.
    sources = {e.source for e in events}
    assert {"router", "cachedir", "link-0"} <= sources
    assert len({e.worker for e in events if isinstance(e, t.WorkerStatus)}) == SMALL_WORKERS
    links = [e for e in events if isinstance(e, t.LinkStats)]
    assert len(links) >= 39 and {(x.a, x.b, x.bandwidth_bps) for x in links} == {
        ("prfaas", "pd", SMALL.bandwidth_bps)}
    assert max(x.throughput_bps for x in links) > 0
    flows: dict[str, list[t.KVFlow]] = {}
    for event in events:
        if isinstance(event, t.KVFlow):
            flows.setdefault(event.request_id, []).append(event)
    for steps in flows.values():
        assert [s.bytes_done for s in steps] == sorted(s.bytes_done for s in steps)
    assert {s[0].via_link for s in flows.values()} == {"link-0", None}
    offloaded = {rid for rid, d in decisions.items() if d.cluster == "prfaas"}
    assert {rid for rid, s in flows.items() if s[0].via_link} <= offloaded


@asynccontextmanager
async def running(sim: LiveSim) -> AsyncIterator[SimControls]:
    """The simulation running in a task, its controls once its world is open."""
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(sim.run, lambda event: None)
        with anyio.fail_after(60):
            while sim.world is None:
                await anyio.sleep(0.1)
        yield SimControls(sim)
        tasks.cancel_scope.cancel()


@pytest.mark.trio
async def test_sim_controls_act_on_the_world(autojump_clock: trio.testing.MockClock) -> None:
    sim = LiveSim(SMALL, config=LiveConfig(rate=2.0, output_len=16))
    assert (await SimControls(sim).state())["errors"]["router"].endswith("not running (yet)")
    async with running(sim) as controls:
        world = sim.world
        assert world is not None and sim.load is not None
        answer = await controls.update_link(LinkUpdate(bandwidth_bps=1e9, delay_ms=20.0))
        assert answer["bandwidth_bps"] == 1e9 and answer["delay_ms"] == pytest.approx(20.0)
        shaper = world.links["link-0"].shaper
        assert shaper.params.bandwidth_bps == 1e9 and shaper.params.delay_s == pytest.approx(0.02)
        router = await controls.set_policy(PolicyRequest("homogeneous"))
        assert router["policy"] == world.scheduler.policy.name == "homogeneous"
        assert router["policies"] == list(POLICIES)  # the one list: the registered policies
        await controls.set_policy(PolicyRequest("prfaas"))
        assert world.scheduler.policy.threshold == 19400 / 8  # the deployment's options again
        pinned = await controls.set_threshold(ThresholdRequest(1000.0))
        assert pinned["threshold"] == 1000.0 and pinned["threshold_override"] is True
        await anyio.sleep(20.0)
        assert sim.load.statistics().sent >= 20
        await controls.workload(WorkloadRequest("stop"))
        sent = sim.load.statistics().sent
        await anyio.sleep(20.0)
        assert sim.load.statistics().sent == sent and not sim.load.running
        load = (await controls.workload(WorkloadRequest("start", rate=5.0, kind="long")))
        assert load["workload"]["running"] and load["workload"]["rate"] == 5.0
        await controls.drain("pd-decode-1")
        assert world.scheduler.workers.get("pd-decode-1").draining
        with pytest.raises(ControlError, match="only PD workers change role") as info:
            await controls.set_role("prfaas-prefill-0", RoleRequest("decode"))
        assert info.value.status == 409
        with pytest.raises(ControlError, match="policy must be one of") as info:
            await controls.set_policy(PolicyRequest("fastest"))
        assert info.value.status == 400
        with pytest.raises(ControlError, match="unknown parameter"):
            await controls.update_link({"nope": 1})
        with pytest.raises(ControlError, match="not paced") as info:
            await controls.set_speed(SpeedRequest(10.0))
        assert info.value.status == 409
        state = await controls.state()
        assert state["sim"]["deployment"] == "small" and state["sim"]["virtual_s"] >= 40
        assert state["link"]["bandwidth_bps"] == 1e9 and state["router"]["policy"] == "prfaas"


# The page's own model, run in node when it is installed (no DOM needed).


def test_page_model_keeps_its_bounds_under_a_flood_of_events() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed; the browser tests cover the page's model")
    # The simulated paper deployment (12 workers) flooded at 30 requests a second.
    deployment = Deployment(bandwidth_bps=2e9, policy_options={"threshold": 19400 / 8})
    events = record_virtual(deployment, 20.0, config=LiveConfig(rate=30.0, output_len=16))
    # A prefill streams one request's KV at a time, so the simulation keeps a dozen transfers
    # in flight at most: 60 more open ones test the page's bound on flows.
    events += [flow(100.0 + i, f"open-{i}", "start") for i in range(60)]
    script = Path(__file__).parent / "ui_fixtures" / "model_check.mjs"
    result = subprocess.run(
        [node, "--experimental-default-type=module", str(script)],
        input=b"\n".join(t.encode_json(e) for e in events),
        capture_output=True,
        timeout=60,
        check=True,
    )
    out = json.loads(result.stdout)
    decisions = [e for e in events if isinstance(e, t.RoutingDecision)]
    assert out["events"] == len(events) and out["workers"] == 12
    assert len(decisions) > 400  # beyond every bound of the page's model
    assert (out["decisions"], out["fresh"], out["requests"]) == (50, 50, 400)
    assert out["maxFlows"] == out["flowBound"] == 48
    assert out["lastDecision"] == decisions[-1].request_id
    assert out["ringAgrees"] and out["boundedKeys"] == "def"
    assert out["waterfall"] == [
        ["queued", 0, 1],
        ["prefill", 1, 2],
        ["transfer", 2, 3],
        ["decode", 3, 5],
    ]
    assert out["waterfallOpen"] == [1, 2, 3, 9]  # a phase still open runs until now
    assert out["slider"] == [2e9, 575, 1e7, 1e11]
    assert out["migrated"] == [1, 2, 1]  # a migrated request's attempts: one timeline
    # A traced request's timeline names its trace (RequestDone.trace_id); an untraced one not.
    assert (out["traced"], out["untraced"]) == ("failed: x · trace 4bf92f35", "failed: x")


def health(queued: list[int], ttft: list[float | None]) -> list[dict[str, Any]]:
    pairs = enumerate(zip(queued, ttft, strict=True))
    return [{"ts": float(i), "queued": q, "ttft": v} for i, (q, v) in pairs]


@pytest.mark.trio
async def test_the_page_draws_every_cluster_and_link_of_two_prfaas_and_reads_t_and_units(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issues 11.2 and 15.3: the page as served for services/cli/topologies/two-prfaas.toml
    (its data attributes), through the topology panel's layout, t's paper length, the rate
    units and the saturation hint, in node."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed; the browser tests cover the page")
    topology = load_topology(TOPOLOGIES / "two-prfaas.toml", "")
    app = build_app(NoSource(), HttpControlClient.connect(None, None),
                    config=dashboard_config(topology))
    async with client_for(app) as client:
        page = (await client.get("/")).text
    links = re.search(r'data-links="([^"]*)"', page)
    scale = re.search(r'data-token-scale="([^"]*)"', page)
    assert links is not None and scale is not None
    workers = [{"cluster": s.cluster} for s in topology.services if s.cluster]
    steady = health([2] * 15, [0.8] * 15)
    growing = health(list(range(15)), [0.8] * 15)
    slower = health([1] * 15, [0.5] * 7 + [1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6])
    script = Path(__file__).parent / "ui_fixtures" / "page_check.mjs"
    request = {"links": links.group(1), "reported": ["link-a", "link-b"],
               "prfaas": ["prfaas-a", "prfaas-b"], "workers": workers,
               "scale": float(scale.group(1)), "t": 606.0, "bandwidth_bps": 200e6,
               "throughput_bps": 3.2e6, "health": [steady, growing, slower, steady[:5]]}
    result = subprocess.run([node, "--experimental-default-type=module", str(script)],
                            input=json.dumps(request).encode(), capture_output=True,
                            timeout=60, check=True)
    out = json.loads(result.stdout)
    boxes, drawn = out["boxes"], out["links"]
    assert sorted(boxes) == ["pd", "prfaas-a", "prfaas-b"]
    assert [b["prfaas"] for b in (boxes["prfaas-a"], boxes["prfaas-b"], boxes["pd"])] == [
        True, True, False]
    # Each link runs from the middle of its own PrfaaS cluster's box into the PD box.
    assert [(ln["name"], ln["a"], ln["b"]) for ln in drawn] == [
        ("link-a", "prfaas-a", "pd"), ("link-b", "prfaas-b", "pd")]
    for line in drawn:
        box, pd = boxes[line["a"]], boxes["pd"]
        assert line["y0"] == box["y"] + box["h"] / 2
        assert pd["y"] <= line["y1"] <= pd["y"] + pd["h"]
    assert drawn[0]["y0"] < drawn[1]["y0"]
    assert out["threshold"] == "606 tokens served = 19.4K at paper length (scale 1/32)"
    assert out["rates"] == ["200 Mbps", "3.20 Mbps"]  # bandwidth and egress in one unit
    assert out["saturation"][0] is None and out["saturation"][3] is None
    assert out["saturation"][1].startswith("mesh saturated: queues growing (0 → 14 queued")
    assert out["saturation"][2].startswith("mesh saturated: TTFT rising (500 ms → 2.60 s")


# The app over HTTP (in process) and served by hypercorn.


@asynccontextmanager
async def client_for(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the page's own origin, sending the CSRF token the page would (ui.guard)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        headers = {"x-csrf-token": app.state.csrf_token}
        async with httpx.AsyncClient(transport=transport, base_url="http://ui",
                                     headers=headers) as client:
            yield client


def sim_app(rate: float = 2.0, **options: Any) -> tuple[Starlette, LiveSim]:
    """The dashboard on the small simulated deployment (its world opens in the lifespan)."""
    sim = LiveSim(SMALL, config=LiveConfig(rate=rate, output_len=16), **options)
    config = DashboardConfig(live_mode="simulated", policies=tuple(POLICIES))
    return build_app(sim, SimControls(sim), config=config), sim


EXTERNAL_URL = re.compile(rb"""(https?:)?//[a-z0-9.-]+\.[a-z]{2,}""", re.I)


def test_page_assets_are_local_only() -> None:
    files: Iterable[Path] = [*(UI / "static").iterdir(), *(UI / "templates").iterdir()]
    for path in files:
        found = [m.group(0) for m in EXTERNAL_URL.finditer(path.read_bytes())]
        assert found in ([], [b"http://www.w3.org"]), (path.name, found)  # the SVG namespace


@pytest.mark.trio
async def test_app_serves_page_static_snapshot_requests_stats_and_metrics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = sim_app()
    async with client_for(app) as client:
        page = await client.get("/")
        assert page.status_code == 200
        for testid in ("topology", "decisions", "charts", "controls", "waterfall", "replay-log",
                       "ctl-speed"):
            assert f'data-testid="{testid}"' in page.text
        assert f'data-policies="{",".join(POLICIES)}"' in page.text
        assert 'src="http://ui/static/app.js"' in page.text
        for name in ("app.js", "style.css", "topology.js", "favicon.svg"):
            assert (await client.get(f"/static/{name}")).status_code == 200
        await anyio.sleep(20.0)
        snapshot = msgspec.json.decode((await client.get("/api/snapshot")).content, type=Snapshot)
        assert snapshot.decisions and snapshot.workers and snapshot.links and snapshot.series
        assert snapshot.mode == "simulated" and snapshot.config.policies == tuple(POLICIES)
        rid = snapshot.decisions[-1].request_id
        view = (await client.get(f"/api/requests/{rid}")).json()
        assert view["decision"]["request_id"] == rid and view["phases"]
        missing = await client.get("/api/requests/nope")
        assert missing.status_code == 404 and missing.json()["error"].startswith(
            "no request 'nope'"
        )
        stats = (await client.get("/api/stats")).json()
        assert stats["hub"]["published"] > 100
        assert stats["state"]["workers"] == SMALL_WORKERS
        metrics = (await client.get("/metrics")).text
        assert re.search(r"^prfaas_ui_hub_published_total \d+", metrics, re.M)
        assert "prfaas_ui_state_decisions " in metrics
        assert "\nprocess_resident_memory_bytes " in metrics
        app.state.hub.check_integrity()


@pytest.mark.trio
async def test_app_forwards_controls_and_rejects_bad_bodies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = PacedClock(60.0)  # never runs: the speed control only sets its rate
    app, sim = sim_app(clock=clock)
    async with client_for(app) as client:
        with anyio.fail_after(60):
            while sim.world is None:
                await anyio.sleep(0.1)
        answer = await client.post("/api/control/link", json={"bandwidth_bps": 3e9, "delay_ms": 40})
        assert answer.status_code == 200 and answer.json()["bandwidth_bps"] == 3e9
        assert sim.world.links["link-0"].shaper.params.delay_s == pytest.approx(0.04)
        await anyio.sleep(1.0)
        hub: EventHub = app.state.hub
        assert hub.state.links["link-0"].bandwidth_bps == 3e9  # reported back as telemetry
        assert (
            await client.post("/api/control/policy", json={"policy": "naive-hetero"})
        ).status_code == 200
        await anyio.sleep(0.1)
        assert hub.state.policy == "naive-hetero"  # the router's ThresholdChanged, as telemetry
        await client.post("/api/control/policy", json={"policy": "prfaas"})
        assert (await client.post("/api/control/threshold", json={"t": 4096})).json()[
            "threshold"
        ] == 4096
        await anyio.sleep(0.1)
        assert hub.state.policy == "prfaas" and hub.state.threshold == 4096
        stopped = await client.post("/api/control/workload", json={"action": "stop"})
        assert stopped.json()["workload"]["running"] is False and sim.load is not None
        assert sim.load.running is False
        await client.post("/api/control/workers/pd-decode-1/drain")
        assert sim.world.scheduler.workers.get("pd-decode-1").draining
        speed = await client.post("/api/control/speed", json={"speed": 600})
        assert speed.status_code == 200 and speed.json()["speed"] == clock.rate == 600
        assert (await client.post("/api/control/speed", json={"speed": 0})).status_code == 400
        state = (await client.get("/api/control/state")).json()
        assert state["router"]["policy"] == "prfaas" and state["link"]["delay_ms"] == 40
        assert state["sim"]["speed"] == 600
        bad = await client.post("/api/control/link", json={"loss": 5})
        assert bad.status_code == 400 and "$.loss" in bad.json()["error"]
        bad = await client.post("/api/control/workload", content=b"{nope")
        assert bad.status_code == 400 and bad.json()["error"].startswith("bad WorkloadRequest")
        conflict = await client.post(
            "/api/control/workers/prfaas-prefill-0/role", json={"role": "decode"}
        )
        assert conflict.status_code == 409


@pytest.mark.trio
async def test_app_replays_a_log_then_returns_to_live(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    recorded = await record_events(SMALL, 12.0, arrivals=conversations(12.0))
    write_event_log(tmp_path / "mine.jsonl", recorded)
    # The live simulation's events are stamped as times of day, told apart from the log's.
    sim = LiveSim(SMALL, config=LiveConfig(rate=2.0, output_len=16))
    app = build_app(sim, SimControls(sim), replay_dirs=(tmp_path,))
    async with client_for(app) as client:
        listing = (await client.get("/api/replay")).json()
        assert [log["name"] for log in listing["logs"]] == ["mine.jsonl", "sample.jsonl"]
        assert listing["status"]["state"] == "idle"
        started = await client.post(
            "/api/replay", json={"action": "play", "name": "mine.jsonl", "speed": 4}
        )
        assert started.json()["state"] == "playing" and started.json()["speed"] == 4
        await anyio.sleep(1.0)
        hub: EventHub = app.state.hub
        assert hub.mode == "replay"
        assert all(d.ts < 12.0 for d in hub.state.decisions)  # only the log's events
        paused = (await client.post("/api/replay", json={"action": "pause"})).json()
        assert paused["state"] == "paused"
        await anyio.sleep(0.5)  # the step under way (at most 0.25 s of wall time) completes
        position = (await client.get("/api/replay")).json()["status"]["position_s"]
        assert paused["position_s"] <= position <= paused["position_s"] + 0.25 * 4
        await anyio.sleep(5.0)
        assert (await client.get("/api/replay")).json()["status"]["position_s"] == position
        await client.post("/api/replay", json={"action": "resume"})
        await anyio.sleep(5.0)
        status = (await client.get("/api/replay")).json()["status"]
        assert status["state"] == "finished" and status["published"] == status["events"]
        missing = await client.post("/api/replay", json={"action": "play", "name": "../etc/passwd"})
        assert missing.status_code == 404
        live = (await client.post("/api/replay", json={"action": "stop"})).json()
        assert live["state"] == "idle" and hub.snapshot().mode == "live"
        # The live load's next arrival is random: wait for it (virtual time, bounded).
        with anyio.fail_after(60):
            while not hub.state.decisions:
                await anyio.sleep(0.5)
        assert hub.state.decisions and all(d.ts > 1000.0 for d in hub.state.decisions)


async def read_sse_until(host: str, port: int, wanted: set[str]) -> tuple[bytes, set[str]]:
    """Reads GET /events over a plain socket until events of every `wanted` type came."""
    seen: set[str] = set()
    received = b""
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(b"GET /events HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        while not wanted <= seen:
            received += await stream.receive()
            body = received.split(b"\r\n\r\n", 1)[-1]
            seen = {kind.decode() for kind in re.findall(rb'"type":"(\w+)"', body)}
    return received, seen


@pytest.fixture
def paced_clock() -> PacedClock:
    """Virtual time at 50x the wall clock (pytest-trio runs the test on it): real sockets,
    and a simulation that shows a minute of traffic in about a second."""
    return PacedClock(50.0)


@pytest.mark.trio
async def test_serve_ui_streams_events_over_real_http_and_stops_cleanly(
    paced_clock: PacedClock,
) -> None:
    sim = LiveSim(SMALL, arrivals=conversations(60.0, rate=2.0), clock=paced_clock)
    async with anyio.create_task_group() as tasks:
        host, port = await tasks.start(serve_ui, "127.0.0.1", 0, sim, SimControls(sim))
        async with paced_client(host, port) as client:
            assert (await client.get("/")).status_code == 200
        with anyio.fail_after(600):  # virtual: 12 s of wall time
            received, seen = await read_sse_until(host, port, {"decision", "worker", "kvflow"})
        tasks.cancel_scope.cancel()
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert b"content-type: text/event-stream" in head and b"event: hello" in received
    assert {"decision", "worker", "kvflow"} <= seen


@pytest.mark.trio
async def test_a_dashboard_without_source_or_services_still_answers() -> None:
    app = build_app(NoSource(), HttpControlClient(None, None))
    async with client_for(app) as client:
        state = (await client.get("/api/control/state")).json()
        assert state["link"] is None and set(state["errors"]) == {"link", "router"}
        answer = await client.post("/api/control/policy", json={"policy": "prfaas"})
        assert answer.status_code == 503
        assert (await client.get("/api/snapshot")).json()["decisions"] == []


# Processes: the supervisor's view through the dashboard, and the guard on its POSTs.

SLEEPER = (f"exec {shlex.quote(sys.executable)} -c "
           "'import time; time.sleep(600)'")


@pytest.mark.trio
async def test_dashboard_shows_a_killed_worker_down_and_back_through_the_supervisor() -> None:
    supervisor = Supervisor([ProcessSpec("router", SLEEPER), ProcessSpec("pd-decode-0", SLEEPER)],
                            dict(os.environ), output=lambda name, line: None,
                            policy=RestartPolicy(initial_backoff_s=0.5, max_backoff_s=1.0))
    api = httpx.AsyncClient(transport=httpx.ASGITransport(app=supervisor_app(supervisor, "tok")),
                            base_url="http://127.0.0.1:8090", headers=bearer_headers("tok"))
    app = build_app(NoSource(), HttpControlClient(None, None, api))
    async with trio.open_nursery() as nursery, client_for(app) as client:
        await nursery.start(supervisor.run)

        async def states() -> dict[str, tuple[str, int]]:
            listed = (await client.get("/api/control/processes")).json()["processes"]
            return {p["name"]: (p["state"], p["pid"]) for p in listed}

        before = await states()
        assert {name: state for name, (state, _) in before.items()} == {
            "router": "up", "pd-decode-0": "up"}
        killed = await client.post("/api/control/processes/pd-decode-0/kill")
        assert killed.status_code == 200
        seen: set[str] = set()
        with trio.fail_after(10):
            while True:
                now = await states()
                seen.add(now["pd-decode-0"][0])
                if now["pd-decode-0"][0] == "up" and now["pd-decode-0"][1] != before[
                        "pd-decode-0"][1]:
                    break
                await trio.sleep(0.05)
        assert "down" in seen
        assert now["router"] == before["router"]
        restarted = (await client.post("/api/control/processes/router/restart")).json()
        assert restarted["restarts"] == 1
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_dashboard_posts_need_its_origin_and_csrf_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, sim = sim_app()
    async with client_for(app) as client:
        with anyio.fail_after(60):
            while sim.world is None:
                await anyio.sleep(0.1)
        page = (await client.get("/")).text
        assert f'<meta name="csrf-token" content="{app.state.csrf_token}">' in page
        evil = await client.post("/api/control/policy", content=b'{"policy": "homogeneous"}',
                                 headers={"origin": "http://evil.example",
                                          "content-type": "text/plain"})
        no_token = await client.post("/api/control/policy", json={"policy": "homogeneous"},
                                     headers={"x-csrf-token": ""})
        wrong = await client.post("/api/control/policy", json={"policy": "homogeneous"},
                                  headers={"x-csrf-token": "guess"})
        assert [r.status_code for r in (evil, no_token, wrong)] == [403, 403, 403]
        assert evil.json()["status"] == 403
        assert sim.world.scheduler.policy.name != "homogeneous"
        same = await client.post("/api/control/policy", json={"policy": "homogeneous"},
                                 headers={"origin": "http://ui"})
        assert same.status_code == 200 and sim.world.scheduler.policy.name == "homogeneous"


@pytest.mark.trio
async def test_http_control_client_sends_the_admin_token() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"processes": []})

    client = HttpControlClient.connect("http://link", "http://router",
                                       supervisor_url="http://sup", token="abc")
    for inner in client._clients.values():
        assert inner is not None
        inner._transport = httpx.MockTransport(handler)
    await client.processes()
    await client.set_policy(PolicyRequest(policy="prfaas"))
    await client.aclose()
    assert seen == ["Bearer abc", "Bearer abc"]


# Access: the dashboard's own Host names only, and the admin token beyond loopback.

ADMIN_TOKEN = "an-admin-token-of-32-characters."


@pytest.mark.trio
async def test_the_dashboard_refuses_a_host_that_is_not_its_own_dns_rebinding() -> None:
    async with anyio.create_task_group() as tasks:
        host, port = await tasks.start(serve_ui, "127.0.0.1", 0, NoSource(),
                                       HttpControlClient(None, None))
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
            rebound = await client.get("/", headers={"host": f"evil.example:{port}"})
            assert rebound.status_code == 403 and "csrf-token" not in rebound.text
            assert "evil.example" in rebound.json()["error"]
            for name in ("127.0.0.1", "localhost"):
                page = await client.get("/", headers={"host": f"{name}:{port}"})
                assert page.status_code == 200 and "csrf-token" in page.text
        tasks.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_dashboard_beyond_loopback_needs_the_admin_token() -> None:
    # Refused before any bind (198.18.0.1 is not on this host anyway).
    with pytest.raises(ConfigError, match=r"the dashboard binds 198\.18\.0\.1, beyond loopback"):
        await serve_ui("198.18.0.1", 0, NoSource(), HttpControlClient(None, None))
    app = build_app(NoSource(), HttpControlClient(None, None))
    # On loopback the token is asked of no one; beyond it, of every request.
    local = AccessGuard.listening_on(app, "127.0.0.1", (), ADMIN_TOKEN)
    guarded = AccessGuard.listening_on(app, "198.18.0.1", ("ui.example",), ADMIN_TOKEN)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=local), base_url="http://127.0.0.1") as client:
        assert (await client.get("/api/snapshot")).status_code == 200
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=guarded), base_url="http://198.18.0.1") as client:
        rebound = await client.get("/", headers={**bearer_headers(ADMIN_TOKEN),
                                                 "host": "evil.example"})
        assert rebound.status_code == 403
        dialled = await client.get("/", headers={**bearer_headers(ADMIN_TOKEN),
                                                 "host": "ui.example:8080"})
        assert dialled.status_code == 200
        assert (await client.get("/")).status_code == 401
        assert (await client.get("/api/snapshot")).status_code == 401
        assert (await client.get("/?token=wrong-token-of-some-length")).status_code == 401
        assert (await client.get("/", headers=bearer_headers(ADMIN_TOKEN))).status_code == 200
        opened = await client.get(f"/?token={ADMIN_TOKEN}")
        assert opened.status_code == 303 and opened.headers["location"] == "/"
        assert "HttpOnly" in opened.headers["set-cookie"]
        assert "SameSite=Strict" in opened.headers["set-cookie"]
        # The client keeps the cookie: the page and its API now answer.
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/api/snapshot")).status_code == 200
