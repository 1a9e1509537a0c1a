"""The dashboard's browser tests run a mesh in a background event loop and drive chromium.

`default_mesh` is today's default mesh as far as the dashboard can see one: the real link
service (netem: proxy and control API) and the synthetic mesh for the router and workers, the
dashboard forwarding link controls to the real link. When the real mesh exists, it replaces
the synthetic part here and the tests stay as they are.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal
from playwright.sync_api import BrowserContext, Playwright

from netem.control import serve_link
from netem.proxy import Route
from netem.shaper import LinkParams
from ui.controls import HttpControlClient
from ui.demo import DemoControls, SyntheticSource
from ui.demo_mesh import SyntheticMesh
from ui.demo_model import SyntheticConfig
from ui.serve import serve_ui

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


@dataclass
class Mesh:
    url: str  # the dashboard
    link_url: str  # the real link's control API
    mesh: SyntheticMesh


@contextmanager
def default_mesh(config: SyntheticConfig) -> Iterator[Mesh]:
    """Link + synthetic mesh + dashboard in one background loop; all stop on exit."""
    portal: BlockingPortal
    with start_blocking_portal(backend="asyncio") as portal:
        params = LinkParams(bandwidth_bps=config.bandwidth_bps, delay_s=config.delay_ms / 1e3)
        # The route's upstream is never dialled: the synthetic mesh moves no real bytes.
        _, endpoints = portal.start_task(serve_link, [Route(0, 9)], params, 0, name=config.link)
        link_url = "http://{}:{}".format(*endpoints.control)
        mesh = SyntheticMesh(msgspec.structs.replace(config, start_ts=time.time()))
        controls = DemoControls(mesh, HttpControlClient.connect(link_url, None))
        _, (host, port) = portal.start_task(
            serve_ui, "127.0.0.1", 0, SyntheticSource(mesh), controls
        )
        try:
            yield Mesh(f"http://{host}:{port}/", link_url, mesh)
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
