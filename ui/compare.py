"""The compare page's app: deployments side by side on the same traffic.

    GET  /                               the page (templates/compare.html, static/compare.js)
    GET  /api/compare?after=T            every deployment's samples after virtual time T, the
                                         summary (ratio of completed rates), the load, the clock
    GET  /d/{name}/events                one deployment's server-sent events (its own hub)
    GET  /d/{name}/api/snapshot          ... its snapshot
    GET  /d/{name}/api/requests/{id}     ... one of its requests
    GET  /api/stats                      every deployment's hub and state statistics
    GET  /api/control/state              the shared load and clock
    POST /api/control/workload           {"action": "start"|"stop", "rate": req/s, "kind"}
    POST /api/control/speed              {"speed": virtual s per wall s}

Each deployment gets the single page's machinery (an `EventHub` folding its events, the SSE
feed, the snapshot), so a column draws what the single page draws. The charts across the
deployments are the source's own samples (`CompareSource.samples`), polled: the simulation
computes them once, on virtual time, where they are tested. POSTs pass ui.guard as on the
single page; controls that belong to one deployment are the source's to refuse.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol, runtime_checkable

import anyio
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from services.contract.events import AnyEvent
from ui.app import HERE, _Controls, _error, _Pages, json_response
from ui.config import DashboardConfig
from ui.controls import ControlClient
from ui.errors import ControlError, UiConfigError
from ui.guard import CsrfGuard
from ui.hub import EventHub

JsonObject = dict[str, Any]


@runtime_checkable
class CompareSource(Protocol):
    """Deployments side by side (the simulation's `CompareSim` has this shape).

    `describe` names each deployment and its links, in the page's order; `run_columns`
    publishes each one's events to its publisher until cancelled; `samples(after)` is the
    page's poll."""

    def describe(self) -> list[JsonObject]: ...

    async def run_columns(self, publishers: Mapping[str, Callable[[AnyEvent], None]]) -> None: ...

    def samples(self, after: float) -> JsonObject: ...


def column_config(base: DashboardConfig, column: Mapping[str, Any]) -> DashboardConfig:
    """One deployment's hub configuration: the page's, with its name, links and scale."""
    links = tuple((str(name), str(a), str(b)) for name, a, b in column.get("links", ()))
    try:
        return DashboardConfig(
            title=str(column["title"]), live_mode=base.live_mode, policies=base.policies,
            prfaas_clusters=base.prfaas_clusters, links=links,
            token_scale=float(column.get("token_scale", base.token_scale)),
            default_rate=base.default_rate, keep_points=base.keep_points)
    except KeyError as exc:
        raise UiConfigError(f"a compared deployment needs a {exc.args[0]!r}") from exc


class _Compare:
    def __init__(self, source: CompareSource, columns: list[JsonObject],
                 hubs: dict[str, EventHub], config: DashboardConfig, csrf_token: str) -> None:
        self.source, self.columns, self.hubs = source, columns, hubs
        self.config, self.csrf_token = config, csrf_token
        self.templates = Jinja2Templates(directory=HERE / "templates")

    async def index(self, request: Request) -> Response:
        context = {"config": self.config, "columns": self.columns,
                   "csrf_token": self.csrf_token}
        return self.templates.TemplateResponse(request, "compare.html", context)

    async def samples(self, request: Request) -> Response:
        text = request.query_params.get("after", "-1")
        try:
            after = float(text)
        except ValueError as exc:
            raise ControlError(400, f"after must be a number of virtual seconds, got "
                                    f"{text!r}") from exc
        return json_response(self.source.samples(after))

    async def stats(self, request: Request) -> Response:
        return json_response({name: {"hub": hub.statistics(), "state": hub.state.statistics()}
                              for name, hub in self.hubs.items()})


def build_compare_app(source: CompareSource, controls: ControlClient, *,
                      config: DashboardConfig | None = None,
                      csrf_token: str | None = None) -> Starlette:
    """The compare page over `source`'s deployments; `controls` act on what they share."""
    base = config or DashboardConfig()
    columns = source.describe()
    if not columns:
        raise UiConfigError("a comparison needs at least one deployment, got none")
    hubs = {str(c["name"]): EventHub(column_config(base, c)) for c in columns}
    token = csrf_token or secrets.token_urlsafe(24)
    page = _Compare(source, columns, hubs, base, token)
    control = _Controls(controls)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(source.run_columns,
                             {name: hub.publish for name, hub in hubs.items()})
            try:
                yield
            finally:
                for hub in hubs.values():
                    hub.close()
                tasks.cancel_scope.cancel()
                await controls.aclose()

    routes: list[Route | Mount] = [
        Route("/", page.index),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        Route("/api/compare", page.samples),
        Route("/api/stats", page.stats),
        Route("/api/control/state", control.state),
        Route("/api/control/workload", control.workload, methods=["POST"]),
        Route("/api/control/speed", control.speed, methods=["POST"]),
    ]
    for name, hub in hubs.items():
        pages = _Pages(hub, CollectorRegistry(auto_describe=False), token)
        routes.append(Mount(f"/d/{name}", routes=[
            Route("/events", pages.events),
            Route("/api/snapshot", pages.snapshot),
            Route("/api/requests/{request_id}", pages.request_view),
        ]))
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ControlError: _error},
                    middleware=[Middleware(CsrfGuard, token=token)])
    app.state.hubs = hubs
    app.state.csrf_token = token
    return app
