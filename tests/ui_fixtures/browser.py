"""The dashboard's browser tests: the meshes they drive and chromium's launch.

`default_mesh` is the real default mesh: router, cache directory, prefill and decode workers,
link and dashboard as `prfaas serve` processes on 127.0.0.1 (ui_fixtures.mesh). The page's
load test measures the page, not the mesh: `synthetic_mesh` feeds it the synthetic mesh (a
real link service beside it, the dashboard in a background event loop) at rates the real
mesh cannot reach on two cores.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal
from playwright.sync_api import BrowserContext, Playwright

from netem.control import serve_link
from netem.proxy import Route
from netem.shaper import LinkParams
from ui.config import DashboardConfig
from ui.controls import HttpControlClient
from ui.demo import DemoControls, SyntheticSource
from ui.demo_mesh import SyntheticMesh
from ui.demo_model import SyntheticConfig
from ui.serve import serve_ui
from ui_fixtures.mesh import real_mesh

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"
# The mesh's children run on the live default backend; PRFAAS_UI_BACKEND picks another.
MESH_BACKEND = os.environ.get("PRFAAS_UI_BACKEND", "uvloop")


@dataclass
class Mesh:
    url: str  # the dashboard
    link_url: str  # the link's control API
    router_url: str  # the router's OpenAI and admin API
    logs: Path  # one NAME.log per service while the mesh runs (kept in test-output/ after)


@contextmanager
def default_mesh() -> Iterator[Mesh]:
    """The real default mesh with its dashboard, as child processes; all stop on exit."""
    with tempfile.TemporaryDirectory(prefix="prfaas-mesh-") as root:
        try:
            with real_mesh(Path(root), backend=MESH_BACKEND) as mesh:
                yield Mesh(mesh.dashboard_url, mesh.link_url, mesh.router_url, Path(root))
        finally:
            _keep_logs(Path(root))


def _keep_logs(root: Path) -> None:
    """The services' logs go next to the screenshots (test output), for a failed run."""
    target = OUTPUT / "mesh-logs"
    target.mkdir(parents=True, exist_ok=True)
    for log in root.glob("*.log"):
        (target / log.name).write_bytes(log.read_bytes())


@dataclass
class Synthetic:
    url: str  # the dashboard
    link_url: str  # the real link's control API
    mesh: SyntheticMesh


@contextmanager
def synthetic_mesh(config: SyntheticConfig) -> Iterator[Synthetic]:
    """Link + synthetic mesh + dashboard (mode `simulated`) in one background loop."""
    portal: BlockingPortal
    with start_blocking_portal(backend="asyncio") as portal:
        params = LinkParams(bandwidth_bps=config.bandwidth_bps, delay_s=config.delay_ms / 1e3)
        # The route's upstream is never dialled: the synthetic mesh moves no real bytes.
        _, endpoints = portal.start_task(serve_link, [Route(0, 9)], params, 0, name=config.link)
        link_url = "http://{}:{}".format(*endpoints.control)
        mesh = SyntheticMesh(msgspec.structs.replace(config, start_ts=time.time()))
        controls = DemoControls(mesh, HttpControlClient.connect(link_url, None))
        _, (host, port) = portal.start_task(
            partial(serve_ui, config=DashboardConfig(live_mode="simulated")),
            "127.0.0.1", 0, SyntheticSource(mesh), controls,
        )
        try:
            yield Synthetic(f"http://{host}:{port}/", link_url, mesh)
        finally:
            # Cancels the dashboard and the link: both shut down in order, then the loop ends.
            portal.call(portal.stop, True)


@dataclass
class Chromium:
    context: BrowserContext
    profile: str

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of this browser's processes so far: renderer, GPU, all.

        Unlike long tasks or frame gaps, it does not grow when a busy host delays the page.
        """
        processes = _processes()
        roots = [pid for pid, (_, cmdline) in processes.items() if self.profile.encode() in cmdline]
        family = set(roots)
        while True:
            more = {pid for pid, (ppid, _) in processes.items() if ppid in family} - family
            if not more:
                break
            family |= more
        return sum(_cpu_seconds(pid) for pid in family)


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(stat[1]), (entry / "cmdline").read_bytes())
            except (OSError, IndexError):
                continue  # the process ended while we looked
    return table


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def chromium(playwright: Playwright) -> Iterator[Chromium]:
    """Debian's chromium with a fresh profile, headless, nothing reaching the network."""
    with tempfile.TemporaryDirectory(prefix="prfaas-ui-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield Chromium(context, profile)
        finally:
            context.close()
