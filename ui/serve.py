"""`serve_ui`: the dashboard served by hypercorn inside anyio, and its standalone entry.

Live it runs on asyncio with uvloop; tests run it on trio. The listening socket is bound here
(port 0 picks a free one) and reported through `task_status`, so a caller knows where to look.
On the real mesh the dashboard is `prfaas serve ui` (ui/feed.py feeds it every
service's events); `ui_main` (`python -m ui`) is the dashboard alone: the offline demo with
`--simulated`, else recorded logs only.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from mesh.http import serve_http
from services.contract.access import token_from_env
from ui.app import build_app
from ui.config import DashboardConfig
from ui.controls import ControlClient, HttpControlClient
from ui.hub import EventHub, EventSource, NoSource

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
    task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serves the dashboard until cancelled; reports the bound (host, port) when listening."""
    hub = EventHub(config or DashboardConfig())
    app = build_app(source, controls, hub=hub, replay_dirs=replay_dirs)
    # Ending the feeds first lets every open event stream finish within the grace.
    await serve_http(app, host, port, log_name="ui.http", before_stop=hub.close,
                     task_status=task_status)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ui", description="the dashboard alone")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--simulated", "--demo", action="store_true", dest="simulated",
                        help="offline demo: feed it a synthetic mesh (the page says 'simulated')")
    parser.add_argument("--link-url", default=DEFAULT_LINK_URL, help="the link's control API")
    parser.add_argument("--router-url", default=DEFAULT_ROUTER_URL, help="the router's admin API")
    parser.add_argument("--replay-dir", type=Path, action="append", default=[])
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic mesh")
    parser.add_argument("--rate", type=float, default=2.0, help="synthetic requests per second")
    return parser


def ui_main(argv: Sequence[str] | None = None) -> int:
    """`python -m ui [--simulated]`: the synthetic mesh, or (without it) recorded logs only;
    the dashboard of the real mesh is `prfaas serve ui`."""
    from ui.demo import synthetic_demo
    from ui.demo_model import SyntheticConfig

    args = _parser().parse_args(argv)
    source: EventSource
    controls: ControlClient
    config = DashboardConfig()
    if args.simulated:
        source, controls = synthetic_demo(SyntheticConfig(seed=args.seed, rate=args.rate))
        config = DashboardConfig(live_mode="simulated")
    else:
        source, controls = NoSource(), HttpControlClient.connect(
            args.link_url, args.router_url, token=token_from_env())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(f"dashboard: http://{args.host}:{args.port}/", flush=True)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            dirs = tuple(args.replay_dir)
            tasks.start_soon(
                partial(serve_ui, config=config, replay_dirs=dirs),
                args.host, args.port, source, controls,
            )
            # SIGTERM (honcho) and SIGINT end it in order: streams closed, server drained.
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tasks.cancel_scope.cancel()
                    break

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    return 0
