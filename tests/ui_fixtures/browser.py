"""The dashboard's browser tests: the meshes they drive and chromium's launch.

`default_mesh` is the real default mesh: router, cache directory, prefill and decode workers,
link and dashboard as `prfaas serve` processes on 127.0.0.1 (ui_fixtures.mesh). The page's
load test measures the page, not the mesh: `sim_dashboard` serves it the simulation (the
live services over an in-memory network, services/sim) in a background trio loop whose
virtual time runs at a chosen speed, so that it reaches rates the real mesh cannot reach on
two cores.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from anyio.from_thread import BlockingPortal, start_blocking_portal
from playwright.sync_api import BrowserContext, Playwright

from mesh.cputime import cpu_seconds
from services.cli.sim_dashboard import serve_sim_dashboard
from services.sim.compare import CompareSim
from services.sim.live import LiveSim
from ui.serve import serve_dashboard
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


@contextmanager
def dashboard(serve: Callable[..., Awaitable[None]], sim: LiveSim | CompareSim) -> Iterator[str]:
    """The page `serve` serves on `sim` (`prfaas sim-dashboard`'s, or its --compare page), in a
    background trio loop on the sim's clock; yields its URL. The simulation and the server
    stop on exit."""
    portal: BlockingPortal
    options = {"clock": sim.clock} if sim.clock is not None else {}
    with start_blocking_portal(backend="trio", backend_options=options) as portal:
        _, (host, port) = portal.start_task(
            partial(serve, server=serve_dashboard), sim, "127.0.0.1", 0)
        try:
            yield f"http://{host}:{port}/"
        finally:
            portal.call(portal.stop, True)


def sim_dashboard(sim: LiveSim) -> AbstractContextManager[str]:
    """The dashboard on `sim`, as `prfaas sim-dashboard` serves it (`dashboard`)."""
    return dashboard(serve_sim_dashboard, sim)


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
        return cpu_seconds(pid)
    except OSError:
        return 0.0  # it ended while we looked


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
