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
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright
from ui_fixtures import browser as ui_fixtures

from services.router.policies import POLICIES
from services.sim.clock import PacedClock
from services.sim.live import LiveConfig, LiveSim
from services.sim.world import Deployment

pytestmark = [pytest.mark.browser, pytest.mark.slow]

if not shutil.which(ui_fixtures.CHROMIUM):
    pytest.skip("Debian's chromium is not installed (make browser)", allow_module_level=True)

WAIT_MS = 30_000


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
    # Frames kept coming while the events did. Frame rate and long-task share are wall-clock
    # figures that a loaded host bends either way: printed above, not bounded here. The CPU
    # the browser burns per wall second only falls when the host is busy, so its bound holds.
    assert report["frames"] >= 2
    assert report["chromium_cpu_cores"] < 0.9
    assert page_errors == []
