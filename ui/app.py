"""The dashboard's ASGI app: the page, its static files, the live feed, snapshot, controls, replay.

    GET  /                       the page (one Jinja2 template; JS and CSS from /static)
    GET  /events                 server-sent events: batches of telemetry events (ui.sse)
    GET  /api/snapshot           the current state, for a page that connects mid-run
    GET  /api/requests/{id}      one request's decision, phases, KV flow and latencies
    GET  /api/stats              the hub's and the state's statistics()
    GET  /api/control/state      the link's and the router's settings, as they report them
    POST /api/control/link       {"bandwidth_bps", "delay_ms", "jitter_ms", "loss", "up"} (partial)
    POST /api/control/policy     {"policy": name}
    POST /api/control/threshold  {"t": tokens or null}
    POST /api/control/workload   {"action": "start"|"stop", "rate": req/s, "kind": "mixed"}
    POST /api/control/workers/{name}/role   {"role": "prefill"|"decode"}
    POST /api/control/workers/{name}/drain
    POST /api/control/speed      {"speed": virtual s per wall s} (a simulation only)
    GET  /api/control/processes  the supervisor's processes: state, pid, restarts, since
    POST /api/control/processes/{name}/kill      SIGKILL (a crash; the supervisor restarts it)
    POST /api/control/processes/{name}/restart   a planned restart
    GET  /api/replay             recorded logs and the replay's status
    POST /api/replay             {"action": "play", "name", "speed"} | pause | resume | speed | stop
    GET  /metrics                Prometheus text of the statistics above

Errors answer `{"error": message, "status": code}`. Every POST passes ui.guard first: its
Origin (when sent) must be the dashboard's and its `x-csrf-token` header the token served in
the page, else 403.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
import msgspec
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from mesh.metrics import register_process, register_statistics, render
from ui.config import DashboardConfig
from ui.controls import (
    ControlClient,
    LinkUpdate,
    PolicyRequest,
    RoleRequest,
    SpeedRequest,
    ThresholdRequest,
    WorkloadRequest,
)
from ui.errors import ControlError, ReplayError
from ui.guard import CsrfGuard
from ui.hub import EventHub, EventSource
from ui.replay import PACKAGED_REPLAYS, ReplayRunner, Sleep
from ui.sse import event_stream

HERE = Path(__file__).parent
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class ReplayCommand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    action: Literal["play", "pause", "resume", "speed", "stop"]
    name: str | None = None
    speed: Annotated[float, msgspec.Meta(gt=0)] = 1.0


def json_response(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


async def decode_body(request: Request, kind: type[T]) -> T:
    """The request's JSON body as `kind`; a 400 naming the bad field otherwise."""
    body = await request.body()
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ControlError(400, f"bad {kind.__name__}: {exc}") from exc


async def _error(request: Request, exc: Exception) -> Response:
    status = exc.status if isinstance(exc, ControlError | ReplayError) else 500
    return json_response({"error": str(exc), "status": status}, status)


class _Pages:
    """The page, the feed and the read-only API."""

    def __init__(self, hub: EventHub, registry: CollectorRegistry, csrf_token: str) -> None:
        self.hub = hub
        self.registry = registry
        self.csrf_token = csrf_token
        self.templates = Jinja2Templates(directory=HERE / "templates")

    async def index(self, request: Request) -> Response:
        context = {"config": self.hub.config, "csrf_token": self.csrf_token}
        return self.templates.TemplateResponse(request, "index.html", context)

    async def events(self, request: Request) -> Response:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            event_stream(self.hub), media_type="text/event-stream", headers=headers
        )

    async def snapshot(self, request: Request) -> Response:
        return json_response(self.hub.snapshot())

    async def request_view(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        view = self.hub.state.request(request_id)
        if view is None:
            raise ControlError(404, f"no request {request_id!r} (never seen, or forgotten)")
        return json_response(view)

    async def stats(self, request: Request) -> Response:
        hub = self.hub
        return json_response({"hub": hub.statistics(), "state": hub.state.statistics()})

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), media_type="text/plain; version=0.0.4")


class _Controls:
    """POST /api/control/...: validate, then forward to the service that owns the setting."""

    def __init__(self, controls: ControlClient) -> None:
        self.controls = controls

    async def state(self, request: Request) -> Response:
        return json_response(await self.controls.state())

    async def link(self, request: Request) -> Response:
        update = await decode_body(request, LinkUpdate)
        return json_response(await self.controls.update_link(update))

    async def policy(self, request: Request) -> Response:
        body = await decode_body(request, PolicyRequest)
        return json_response(await self.controls.set_policy(body))

    async def threshold(self, request: Request) -> Response:
        body = await decode_body(request, ThresholdRequest)
        return json_response(await self.controls.set_threshold(body))

    async def workload(self, request: Request) -> Response:
        body = await decode_body(request, WorkloadRequest)
        return json_response(await self.controls.workload(body))

    async def role(self, request: Request) -> Response:
        body = await decode_body(request, RoleRequest)
        worker = request.path_params["name"]
        return json_response(await self.controls.set_role(worker, body))

    async def drain(self, request: Request) -> Response:
        return json_response(await self.controls.drain(request.path_params["name"]))

    async def speed(self, request: Request) -> Response:
        body = await decode_body(request, SpeedRequest)
        return json_response(await self.controls.set_speed(body))
    async def processes(self, request: Request) -> Response:
        return json_response(await self.controls.processes())

    async def kill(self, request: Request) -> Response:
        return json_response(await self.controls.kill(request.path_params["name"]))

    async def restart(self, request: Request) -> Response:
        return json_response(await self.controls.restart(request.path_params["name"]))


class _Replay:
    def __init__(self, runner: ReplayRunner) -> None:
        self.runner = runner

    async def list(self, request: Request) -> Response:
        return json_response({"logs": self.runner.logs(), "status": self.runner.status()})

    async def command(self, request: Request) -> Response:
        command = await decode_body(request, ReplayCommand)
        runner = self.runner
        if command.action == "play":
            if command.name is None:
                raise ReplayError("play needs the name of a log")
            return json_response(await runner.play(command.name, command.speed))
        actions: dict[str, Callable[[], Any]] = {
            "pause": runner.pause,
            "resume": runner.resume,
            "speed": lambda: runner.set_speed(command.speed),
            "stop": runner.stop,
        }
        return json_response(actions[command.action]())


def _registry(hub: EventHub) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    register_process(registry)
    register_statistics(registry, "prfaas_ui_hub", hub.statistics)
    register_statistics(registry, "prfaas_ui_state", lambda: hub.state.statistics())
    return registry


def build_app(
    source: EventSource,
    controls: ControlClient,
    *,
    config: DashboardConfig | None = None,
    hub: EventHub | None = None,
    replay_dirs: tuple[Path, ...] = (),
    replay_sleep: Sleep = anyio.sleep,
    csrf_token: str | None = None,
) -> Starlette:
    """The dashboard app: `source` feeds it (a task of its lifespan), `controls` act on the mesh.

    Replays are looked up in `replay_dirs`, then in the packaged `ui/replays/`; they wait
    with `replay_sleep`, given wall seconds (a simulation's loop runs on virtual time: it
    passes a sleep that converts). POSTs need `csrf_token` (a fresh random one unless given;
    `app.state.csrf_token`) and no foreign Origin (ui.guard).
    """
    hub = hub if hub is not None else EventHub(config or DashboardConfig())
    token = csrf_token or secrets.token_urlsafe(24)
    runner = ReplayRunner(hub, (*replay_dirs, PACKAGED_REPLAYS), replay_sleep)
    pages, control = _Pages(hub, _registry(hub), token), _Controls(controls)
    replay = _Replay(runner)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            runner.attach(tasks)
            tasks.start_soon(source.run, hub.publish)
            try:
                yield
            finally:
                hub.close()
                tasks.cancel_scope.cancel()
                await controls.aclose()

    routes = [
        Route("/", pages.index),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        Route("/events", pages.events),
        Route("/api/snapshot", pages.snapshot),
        Route("/api/requests/{request_id}", pages.request_view),
        Route("/api/stats", pages.stats),
        Route("/metrics", pages.metrics),
        Route("/api/control/state", control.state),
        Route("/api/control/link", control.link, methods=["POST"]),
        Route("/api/control/policy", control.policy, methods=["POST"]),
        Route("/api/control/threshold", control.threshold, methods=["POST"]),
        Route("/api/control/workload", control.workload, methods=["POST"]),
        Route("/api/control/workers/{name}/role", control.role, methods=["POST"]),
        Route("/api/control/workers/{name}/drain", control.drain, methods=["POST"]),
        Route("/api/control/speed", control.speed, methods=["POST"]),
        Route("/api/control/processes", control.processes),
        Route("/api/control/processes/{name}/kill", control.kill, methods=["POST"]),
        Route("/api/control/processes/{name}/restart", control.restart, methods=["POST"]),
        Route("/api/replay", replay.list),
        Route("/api/replay", replay.command, methods=["POST"]),
    ]
    handlers = {ControlError: _error, ReplayError: _error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                    middleware=[Middleware(CsrfGuard, token=token)])
    app.state.hub = hub
    app.state.csrf_token = token
    app.state.replay = runner
    return app
