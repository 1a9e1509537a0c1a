"""`serve_ui`: the dashboard served by hypercorn inside anyio, and its standalone entry.

Live it runs on asyncio with uvloop; tests run it on trio. The listening socket is bound here
(port 0 picks a free one) and reported through `task_status`, so a caller knows where to look.
On the real mesh the dashboard is `prfaas serve ui` (ui/feed.py feeds it every
service's events); on the simulation it is `prfaas sim-dashboard` (services/cli/sim_dashboard.py
finds `serve_dashboard` through the entry point `prfaas.dashboard:serve`: services never
import ui; with --compare it serves ui/compare.py's page); `ui_main` (`python -m ui`) is
the dashboard alone: recorded logs, controls forwarded to a link and a router if they run.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from mesh.http import serve_http
from services.contract.access import (
    require_token_beyond_loopback,
    token_from_env,
)
from ui.app import build_app
from ui.compare import CompareSource, build_compare_app
from ui.config import DashboardConfig
from ui.controls import ControlClient, HttpControlClient
from ui.errors import UiConfigError
from ui.guard import AccessGuard
from ui.hub import EventHub, EventSource, NoSource
from ui.replay import Sleep

DEFAULT_PORT = 8080
DEFAULT_LINK_URL = "http://127.0.0.1:8474"
DEFAULT_ROUTER_URL = "http://127.0.0.1:8000"


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), reuse_port=False)
    sock.setblocking(False)
    return sock


async def serve_ui(
    host: str,
    port: int,
    source: EventSource,
    controls: ControlClient,
    *,
    config: DashboardConfig | None = None,
    replay_dirs: tuple[Path, ...] = (),
    replay_sleep: Sleep = anyio.sleep,
    admin_token: str | None = None,
    names: Sequence[str] = (),
    task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serves the dashboard until cancelled; reports the bound (host, port) when listening.

    `replay_sleep` waits wall seconds for the replays (see `build_app`). A source that
    compares deployments (ui.compare's `CompareSource`) gets the compare page instead.
    Requests must name the dashboard in their Host (a loopback name, `host` or one of
    `names`: where it is dialled); beyond loopback every request needs `admin_token`
    (ui.guard.AccessGuard), and without one the dashboard refuses to start."""
    require_token_beyond_loopback(host, admin_token, "the dashboard")
    if isinstance(source, CompareSource):
        app = build_compare_app(source, controls, config=config)
        hubs = list(app.state.hubs.values())
    else:
        hubs = [EventHub(config or DashboardConfig())]
        app = build_app(source, controls, hub=hubs[0], replay_dirs=replay_dirs,
                        replay_sleep=replay_sleep)

    def close_feeds() -> None:
        for hub in hubs:
            hub.close()

    guarded = AccessGuard.listening_on(app, host, tuple(names), admin_token)
    # Ending the feeds first lets every open event stream finish within the grace.
    await serve_http(guarded, host, port, log_name="ui.http", before_stop=close_feeds,
                     task_status=task_status)


async def serve_dashboard(
    host: str,
    port: int,
    source: EventSource,
    controls: ControlClient,
    *,
    options: Mapping[str, Any] | None = None,
    replay_dirs: tuple[Path, ...] = (),
    replay_sleep: Sleep = anyio.sleep,
    task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """`serve_ui` for callers that cannot import ui: the simulation's CLI finds it through the
    entry point `prfaas.dashboard:serve`, and gives the configuration as plain options (the
    fields of `DashboardConfig`), checked here."""
    try:
        config = msgspec.convert(dict(options or {}), DashboardConfig)
    except msgspec.ValidationError as exc:
        raise UiConfigError(f"dashboard options: {exc}") from exc
    await serve_ui(host, port, source, controls, config=config, replay_dirs=replay_dirs,
                   replay_sleep=replay_sleep, admin_token=token_from_env(),
                   task_status=task_status)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ui", description="the dashboard alone")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--link-url", default=DEFAULT_LINK_URL, help="the link's control API")
    parser.add_argument("--router-url", default=DEFAULT_ROUTER_URL, help="the router's admin API")
    parser.add_argument("--replay-dir", type=Path, action="append", default=[])
    return parser


def ui_main(argv: Sequence[str] | None = None) -> int:
    """`python -m ui`: recorded logs, and the controls of a link and a router if they run;
    the dashboard of the real mesh is `prfaas serve ui`, of the simulation
    `prfaas sim-dashboard`."""
    args = _parser().parse_args(argv)
    source: EventSource = NoSource()
    controls: ControlClient = HttpControlClient.connect(args.link_url, args.router_url,
                                                        token=token_from_env())
    config = DashboardConfig()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(f"dashboard: http://{args.host}:{args.port}/", flush=True)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            dirs = tuple(args.replay_dir)
            tasks.start_soon(
                partial(serve_ui, config=config, replay_dirs=dirs,
                        admin_token=token_from_env()),
                args.host, args.port, source, controls,
            )
            # SIGTERM (honcho) and SIGINT end it in order: streams closed, server drained.
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tasks.cancel_scope.cancel()
                    break

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    return 0
