"""The dashboard in Debian's chromium (Playwright): it fills, it controls, it stays responsive.

The first test drives the real default mesh (every service a `prfaas serve` process); the
load test measures the page on the simulation (`prfaas sim-dashboard`) run fast, and drives
its speed control. Run alone with
`pytest -m browser tests/test_ui_browser.py -s` to see the measured numbers. Screenshots go
to test-output/, with the mesh's service logs in test-output/mesh-logs/.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from playwright.sync_api import Page, sync_playwright
from ui_fixtures import browser as ui_fixtures

from mesh.topology import load_topology
from services.contract import events as ev
from services.contract.events import AnyEvent
from services.router.policies import POLICIES
from services.sim.clock import PacedClock
from services.sim.live import LiveConfig, LiveSim
from services.sim.world import Deployment
from ui.errors import ControlError
from ui.feed import dashboard_config
from ui.serve import serve_ui

pytestmark = [pytest.mark.browser, pytest.mark.slow]

if not shutil.which(ui_fixtures.CHROMIUM):
    pytest.skip("Debian's chromium is not installed (make browser)", allow_module_level=True)

WAIT_MS = 30_000
TOPOLOGIES = Path(__file__).resolve().parent.parent / "services" / "cli" / "topologies"


@pytest.fixture
def page_errors() -> list[str]:
    return []


def open_page(page: Page, url: str, errors: list[str], mode: str = "live") -> None:
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.wait_for_function(
        "mode => document.getElementById('mode').textContent === mode", arg=mode, timeout=WAIT_MS
    )


def count(page: Page, selector: str) -> int:
    return int(page.eval_on_selector_all(selector, "nodes => nodes.length"))


def wait_until(page: Page, script: str, arg: Any = None) -> None:
    page.wait_for_function(script, arg=arg, timeout=WAIT_MS)


def set_range(page: Page, selector: str, value: int) -> None:
    page.eval_on_selector(
        selector,
        """(node, value) => {
            node.value = value;
            node.dispatchEvent(new Event('input'));
            node.dispatchEvent(new Event('change'));
        }""",
        value,
    )


@pytest.fixture
def browser() -> Iterator[Any]:
    with sync_playwright() as playwright, ui_fixtures.chromium(playwright) as browser:
        yield browser


@pytest.fixture
def browser_page(browser: Any) -> Page:
    page: Page = browser.context.new_page()
    return page


# Chart points of the page's model whose `field` holds a value (not a gap).
POINTS_WITH = (
    "field => window.prfaasDashboard.model.series.toArray()"
    ".filter(p => p[field] !== null && p[field] > 0).length"
)


def points_with(page: Page, field: str) -> int:
    return int(page.evaluate(POINTS_WITH, field))


def test_real_mesh_fills_the_dashboard_and_the_link_obeys_it(
    browser_page: Page, page_errors: list[str]
) -> None:
    """Issue 6: the default mesh's real services, a small workload from the page."""
    page = browser_page
    with ui_fixtures.default_mesh() as mesh:
        open_page(page, mesh.url, page_errors)
        # Every worker reports itself, and the link its samples.
        wait_until(page, "document.querySelectorAll('#topology .chip').length === 3")
        wait_until(page, "document.getElementById('topbar-link').textContent === 'up · 200 Mbps'")
        assert count(page, "#decisions-body tr") == 0  # no workload yet

        # A small workload from the page: the router's demo load (POST /admin/workload).
        page.fill("#ctl-rate", "1")
        page.click("#ctl-start")
        wait_until(page, "document.querySelectorAll('#decisions-body tr').length >= 4")
        wait_until(page, "document.querySelectorAll('[data-testid=kv-flow]').length >= 1")
        state = httpx.get(f"{mesh.router_url}/admin/state").json()
        assert state["workload"]["running"] and state["workload"]["rate"] == 1
        # The charts get points: finished requests' TTFT and throughput, the link's egress.
        for field in ("ttft_p50_s", "throughput_rps", "egress_gbps"):
            wait_until(page, f"() => ({POINTS_WITH})({json.dumps(field)}) >= 3")

        # Slide the bandwidth down to 20 Mbps: the link takes it and reports it back.
        set_range(page, "#ctl-bandwidth", 75)
        wait_until(
            page,
            "document.querySelector('[data-testid=link-bandwidth]')"
            ".textContent.startsWith('20 Mbps')",
        )
        assert httpx.get(f"{mesh.link_url}/link").json()["bandwidth_bps"] == 20e6
        wait_until(page, "document.getElementById('topbar-link').textContent === 'up · 20 Mbps'")
        # Beside the rate set, the link as the router measures it from its own transfers.
        wait_until(page, "document.querySelector('[data-testid=link-measured]')"
                         ".textContent.startsWith('router measures ')")
        assert "ok" in (page.text_content("#ctl-status") or "")

        # A finished offloaded request's waterfall once the charts hold some history; the
        # slower link keeps a transfer in flight for the screenshot (docs/dashboard.png).
        wait_until(page, f"() => ({POINTS_WITH})('ttft_p50_s') >= 15")
        finished = "#decisions-body tr[data-cluster=prfaas]"
        page.dispatch_event(f"{finished} >> nth=-1", "click")  # no scrolling, unlike click
        wait_until(page, "document.querySelector('[data-testid=waterfall-decode]') !== null")
        wait_until(
            page,
            "[...document.querySelectorAll('[data-testid=kv-flow]')]"
            ".some(f => !f.classList.contains('done'))",
        )
        ui_fixtures.OUTPUT.mkdir(exist_ok=True)
        page.screenshot(path=str(ui_fixtures.OUTPUT / "dashboard.png"), full_page=True)
        assert points_with(page, "offload") >= 1  # some prefill went to the PrfaaS cluster

        # Filter the table by cluster.
        rows = "[...document.querySelectorAll('#decisions-body tr')]"
        page.select_option("#filter-cluster", "pd")
        wait_until(page, f"{rows}.length > 0 && {rows}.every(r => r.dataset.cluster === 'pd')")
        page.select_option("#filter-cluster", "")

        # Replay the packaged log, then go back to the live feed.
        wait_until(page, "document.querySelector('#replay-log').options.length >= 1")
        page.select_option("#replay-log", "sample.jsonl")
        page.select_option("#replay-speed", "20")
        page.click("#replay-play")
        wait_until(page, "document.getElementById('mode').textContent === 'replay'")
        # The log's clock starts at zero: its rows show seconds, not times of day.
        wait_until(
            page, f"{rows}.length >= 5 && {rows}.every(r => r.cells[0].textContent.endsWith(' s'))"
        )
        page.screenshot(path=str(ui_fixtures.OUTPUT / "dashboard-replay.png"))
        page.click("#replay-live")
        wait_until(page, "document.getElementById('mode').textContent === 'live'")
        stopped = httpx.post(f"{mesh.router_url}/admin/workload", json={"action": "stop"})
        assert stopped.status_code == 200
    assert page_errors == []


MEASURE = """
() => {
  const perf = { longtasks: [], gaps: [], nodes: [], stop: false };
  new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) perf.longtasks.push(entry.duration);
  }).observe({ type: "longtask" });
  let last = performance.now();
  const tick = (now) => {
    perf.gaps.push(now - last);
    last = now;
    if (!perf.stop) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  perf.timer = setInterval(() => perf.nodes.push(document.getElementsByTagName("*").length), 250);
  perf.events0 = window.prfaasDashboard.model.events;
  perf.timings0 = { ...window.prfaasDashboard.timings };
  perf.t0 = performance.now();
  window.__perf = perf;
}
"""

COLLECT = """
() => {
  const perf = window.__perf;
  perf.stop = true;
  clearInterval(perf.timer);
  return {
    seconds: (performance.now() - perf.t0) / 1000,
    events: window.prfaasDashboard.model.events - perf.events0,
    dropped: window.prfaasDashboard.feed.dropped,
    longtasks: perf.longtasks,
    gaps: perf.gaps,
    nodes: perf.nodes,
    rows: document.querySelectorAll("#decisions-body tr").length,
    flows: document.querySelectorAll("[data-testid=kv-flow]").length,
    panels_ms: Object.fromEntries(Object.entries(window.prfaasDashboard.timings)
      .map(([k, v]) => [k, Math.round(v - perf.timings0[k])])),
  };
}
"""


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def test_the_fast_simulation_keeps_the_page_responsive_and_bounded(
    browser: Any, browser_page: Page, page_errors: list[str]
) -> None:
    page = browser_page
    # 24 workers, 2 requests per virtual second at 20x: 40 req/s of wall time, about 15
    # events each (decision, phases, KV flow steps, cache, done), plus 24 worker and one link
    # sample a virtual second: 700 events a second if the host keeps up (virtual time slows
    # down, rather than run ahead, when it does not).
    deployment = Deployment(n_prfaas=8, n_pd_prefill=8, n_decode=8,
                            policy_options={"threshold": 19400 / 8})
    sim = LiveSim(deployment, config=LiveConfig(rate=2.0, output_len=64), clock=PacedClock(20))
    with ui_fixtures.sim_dashboard(sim) as url:
        open_page(page, url, page_errors, mode="simulated")
        # The page offers the registered policies and the simulation's speed control.
        options = page.eval_on_selector_all("#ctl-policy option", "os => os.map(o => o.value)")
        assert options == list(POLICIES)
        wait_until(page, "!document.getElementById('ctl-sim').hidden")
        page.select_option("#ctl-speed", "10")
        wait_until(page, "document.getElementById('ctl-status').textContent.includes('ok')")
        assert sim.clock is not None and sim.clock.rate == 10
        page.select_option("#ctl-speed", "60")
        wait_until(page, "() => document.getElementById('ctl-status').textContent"
                         ".includes('speed: {\"speed\":60} ok')")
        # Warm up until the table and the charts reach their steady size, then measure over
        # the next 5000 events (about seven seconds).
        wait_until(page, "window.prfaasDashboard.model.events >= 1500")
        page.evaluate(MEASURE)
        cpu_start = browser.cpu_seconds()
        wait_until(page, "window.prfaasDashboard.model.events - window.__perf.events0 >= 5000")
        result = page.evaluate(COLLECT)
        cpu = browser.cpu_seconds() - cpu_start
        page.screenshot(path=str(ui_fixtures.OUTPUT / "dashboard-load.png"))
        stats = httpx.get(url + "api/stats").json()
    gaps, nodes, longtasks = result["gaps"], result["nodes"], result["longtasks"]
    report = {
        "events_per_s": round(result["events"] / result["seconds"]),
        "frames": len(gaps),
        "frame_gap_ms_p50": round(quantile(gaps, 0.5), 1),
        "frame_gap_ms_p95": round(quantile(gaps, 0.95), 1),
        "frame_gap_ms_max": round(max(gaps), 1),
        "long_tasks": len(longtasks),
        "long_task_ms_total": round(sum(longtasks)),
        "long_task_ms_max": round(max(longtasks, default=0)),
        "dom_nodes_min": min(nodes),
        "dom_nodes_max": max(nodes),
        "table_rows": result["rows"],
        "flows_drawn": result["flows"],
        "browser_dropped": result["dropped"],
        "server_dropped": stats["hub"]["dropped"],
        "script_ms_by_panel": result["panels_ms"],
        "chromium_cpu_cores": round(cpu / result["seconds"], 2),
    }
    print("\nload test:", json.dumps(report))
    # How many events a second the page takes is a speed figure (printed above, for a
    # benchmark to hold); here, that none of the 5000 was dropped on the way.
    assert report["browser_dropped"] == 0 and report["server_dropped"] == 0
    # Bounded DOM: the table keeps 100 rows, flows at most 48, whatever the rate.
    assert report["dom_nodes_max"] < 3500 and report["table_rows"] <= 100
    # No growth over time, once the page has filled its table (the simulation's first
    # requests take a while to finish): the second half of the samples stays within 600.
    settled = nodes[len(nodes) // 2:]
    assert max(settled) - min(settled) < 600
    # Frames kept coming while the events did. Frame rate, long-task share and the CPU the
    # browser burns are figures of the host as much as of the page (CI measured 0.93 cores on
    # a host that drew 55 frames a second, this machine 0.6 to 0.8): printed above, not bounded.
    assert report["frames"] >= 2
    assert page_errors == []


class ScriptedSource:
    """The dashboard's event source, fed by the test (through the portal) instead of a mesh."""

    def __init__(self) -> None:
        self.publish: Callable[[AnyEvent], None] | None = None

    async def run(self, publish: Callable[[AnyEvent], None]) -> None:
        self.publish = publish
        await anyio.sleep_forever()

    def send(self, events: list[AnyEvent]) -> None:
        assert self.publish is not None
        for event in events:
            self.publish(event)


class StateOnlyControls:
    """A router and a link as their admin and control APIs report them; no changes taken."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    async def state(self) -> dict[str, Any]:
        router = {"policy": "prfaas", "threshold": self.threshold, "threshold_override": False,
                  "policies": list(POLICIES), "workers": []}
        link = {"name": "link-a", "bandwidth_bps": 200e6, "delay_ms": 10, "loss": 0.0,
                "up": True}
        return {"link": link, "router": router, "errors": {}}

    async def processes(self) -> dict[str, Any]:
        return {"processes": [], "stopping": False}

    def __getattr__(self, name: str) -> Any:
        async def refuse(*args: Any) -> Any:
            raise ControlError(409, f"{name}: this test's controls only report")
        return refuse

    async def aclose(self) -> None:
        return None


def two_prfaas_events(now: float, scale: float) -> list[AnyEvent]:
    """Both PrfaaS clusters' workers, both links, a full and an incremental KV flow in flight
    (one over each link) and one decision whose reason is longer than its column."""
    t = 19400 * scale
    workers = [("prfaas-a-prefill-0", "prfaas-a", "prefill"),
               ("prfaas-b-prefill-0", "prfaas-b", "prefill"),
               ("pd-prefill-0", "pd", "prefill"), ("pd-decode-0", "pd", "decode")]
    out: list[AnyEvent] = [
        ev.WorkerStatus(ts=now, source=w, worker=w, cluster=c, role=r,  # type: ignore[arg-type]
                        queue_depth=0, running=0, busy=False, cached_blocks=0,
                        model="kimi-linear default bfloat16")
        for w, c, r in workers]
    out += [ev.LinkStats(ts=now, source=name, link=name, bandwidth_bps=200e6, delay_s=0.01,
                         jitter_s=0.0, loss=0.0, up=True, throughput_bps=3.2e6,
                         utilisation=0.016, queued_bytes=0, stalls=0)
            for name in ("link-a", "link-b")]
    for rid, src, via, incremental in (("full-1", "prfaas-a-prefill-0", "link-a", False),
                                       ("incr-2", "prfaas-b-prefill-0", "link-b", True)):
        out.append(ev.KVFlow(ts=now, source=src, request_id=rid, src=src, dst="pd-decode-0",
                             via_link=via, phase="progress", layers_done=4, layers_total=27,
                             bytes_done=1 << 20, bytes_total=8 << 20, incremental=incremental,
                             tokens_sent=900))
    reason = (f"prfaas: l = 1,200 - 0 = 1,200 > t = {t:,.0f} -> PrfaaS (link calm (util 2% < "
              "50%): best cache anywhere counts)")
    out.append(ev.RoutingDecision(
        ts=now, source="router", request_id="req-0123456789abcdef-1", policy="prfaas",
        total_len=1200, cached_prfaas=0, cached_pd=0, incremental_len=1200, threshold=t,
        link_utilisation=0.016, queue_prfaas=0, queue_pd=0, cluster="prfaas-a",
        prefill_worker="prfaas-a-prefill-0", decode_worker="pd-decode-0",
        bandwidth_scarce=False, reason=reason))
    return out


def queues_growing(now: float) -> list[AnyEvent]:
    """A PD prefill worker whose queue grows by one a second for 20 s, the link sampled
    every second meanwhile (so the hub cuts a chart point each second)."""
    out: list[AnyEvent] = []
    for i in range(1, 21):
        out.append(ev.WorkerStatus(ts=now + i, source="pd-prefill-0", worker="pd-prefill-0",
                                   cluster="pd", role="prefill", queue_depth=i, running=1,
                                   busy=True, cached_blocks=0))
        out.append(ev.LinkStats(ts=now + i, source="link-a", link="link-a", bandwidth_bps=200e6,
                                delay_s=0.01, jitter_s=0.0, loss=0.0, up=True,
                                throughput_bps=3.2e6, utilisation=0.016, queued_bytes=0,
                                stalls=0))
    return out


TEXT = "id => document.querySelector(`[data-testid=${id}]`).textContent"


def test_two_prfaas_page_draws_both_links_reads_t_units_and_colours_flows(
    browser_page: Page, page_errors: list[str]
) -> None:
    """Issues 11.2, 14.5, 15.3: the page for services/cli/topologies/two-prfaas.toml fed
    scripted events: both PrfaaS clusters and both links drawn, t with its paper length,
    rates in one printed unit, top-bar defaults before any request, full and incremental KV
    flows in different colours, whole texts on hover, the saturation hint."""
    page = browser_page
    topology = load_topology(TOPOLOGIES / "two-prfaas.toml", "")
    config = dashboard_config(topology)
    scale = config.token_scale
    source = ScriptedSource()
    controls = StateOnlyControls(threshold=19400 * scale)
    with start_blocking_portal(backend="trio") as portal:
        _, (host, port) = portal.start_task(
            partial(serve_ui, config=config), "127.0.0.1", 0, source, controls)
        open_page(page, f"http://{host}:{port}/", page_errors)
        # Before any request: the router's policy and t, the link's rate; never "-" or "none".
        paper_t = "606 tokens served = 19.4K at paper length (scale 1/32)"
        wait_until(page, f"() => ({TEXT})('topbar-threshold') === {json.dumps(paper_t)}")
        top = {k: page.evaluate(TEXT, f"topbar-{k}") for k in ("policy", "offload", "link")}
        assert top == {"policy": "prfaas", "offload": "no requests yet", "link": "up · 200 Mbps"}
        assert page.input_value("#ctl-rate") == str(config.default_rate)

        portal.call(source.send, two_prfaas_events(time.time(), scale))
        wait_until(page, "document.querySelectorAll('[data-testid=kv-flow]').length === 2")
        wait_until(page, "document.querySelectorAll('#decisions-body tr').length === 1")
        boxes = page.eval_on_selector_all("#topology .cluster-box",
                                          "bs => bs.map(b => b.dataset.cluster)")
        assert sorted(boxes) == ["pd", "prfaas-a", "prfaas-b"]
        # What each worker serves, its dtype included, on hover.
        tip = page.eval_on_selector("[data-worker=pd-decode-0] title", "t => t.textContent")
        assert tip == ("pd-decode-0: decode · q 0 · run 0, kimi-linear default bfloat16, "
                       "0 cached blocks")
        links = page.eval_on_selector_all(
            "[data-testid=link]", """gs => gs.map(g => [g.dataset.link,
                g.querySelector('[data-testid=link-bandwidth]').textContent,
                g.querySelector('[data-testid=link-utilisation]').textContent])""")
        assert links == [[name, "200 Mbps · 10 ms", "egress 3.20 Mbps of 200 Mbps (2%)"]
                         for name in ("link-a", "link-b")]
        both = "link-a up · 200 Mbps; link-b up · 200 Mbps"
        wait_until(page, f"() => ({TEXT})('topbar-link') === {json.dumps(both)}")
        # Full and incremental KV in two colours, the legend's.
        fills = page.eval_on_selector_all(
            "[data-testid=kv-flow]", """fs => Object.fromEntries(fs.map(f => [f.dataset.request,
                [f.getAttribute('class'), getComputedStyle(f.querySelector('circle')).fill]]))""")
        assert fills["full-1"][0].split()[:2] == ["flow", "full"]
        assert fills["incr-2"][0].split()[:2] == ["flow", "incremental"]
        assert fills["full-1"][1] == "rgb(122, 94, 168)"  # --full
        assert fills["incr-2"][1] == "rgb(31, 138, 138)"  # --incremental
        # The row's cut texts whole on hover; t at paper length too.
        row = page.eval_on_selector(
            "#decisions-body tr", "r => [...r.cells].map(c => c.getAttribute('title'))")
        assert row[1] == "req-0123456789abcdef-1"
        assert row[6] == "t = 606 tokens served = 19.4K at paper length (scale 1/32)"
        assert row[9] is not None and row[9].endswith("best cache anywhere counts)")
        assert page.is_hidden("[data-testid=saturation]")

        # Queues grow for 20 s: the page says the mesh is saturated; the egress chart's unit.
        portal.call(source.send, queues_growing(time.time()))
        wait_until(page, "!document.querySelector('[data-testid=saturation]').hidden")
        banner = page.evaluate(TEXT, "saturation")
        assert banner.startswith("mesh saturated: queues growing") and "lower the rate" in banner
        assert page.evaluate(TEXT, "chart-egress-title") == "egress / bandwidth (Mbps)"
        assert page.evaluate(TEXT, "chart-egress-value").endswith(" Mbps")
        assert page.evaluate(TEXT, "chart-threshold-value").endswith("(19.4K paper)")
        ui_fixtures.OUTPUT.mkdir(exist_ok=True)
        page.screenshot(path=str(ui_fixtures.OUTPUT / "dashboard-two-prfaas.png"), full_page=True)
        portal.call(portal.stop, True)
    assert page_errors == []
