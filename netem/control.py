"""The link's live HTTP control API, its `/metrics`, and `serve_link` (proxy + API together).

JSON API (errors are `{"error": message, "status": code}`, as Toxiproxy answers). Every
request passes netem/control_access.py: its Host must name the API (where serve_link binds
it, where it is dialled, or loopback); writes (POST, DELETE) also same origin only, JSON
bodies only, and with `Authorization: Bearer <admin_token>` when serve_link has a token
(required beyond loopback).

    GET  /link                     parameters (API units) and statistics
    POST /link                     partial update: bandwidth_bps, delay_ms, jitter_ms, loss,
                                   rto_ms, up; applied live
    GET  /proxies                  Toxiproxy: {name: proxy}, each with the link's toxics
    GET  /proxies/{name}           one proxy; POST {"enabled": false} takes the link down
    GET  /proxies/{name}/toxics    POST creates: latency {latency, jitter} (ms),
                                   bandwidth {rate} (KB/s), timeout {timeout},
                                   packet_loss {loss_rate}
    GET|POST|DELETE /proxies/{name}/toxics/{toxic}
    POST /reset                    every toxic removed, link up
    GET  /metrics                  Prometheus text, from `LinkProxy.statistics()`
                                   (netem.link_metrics)

Toxics are views of the one set of link parameters, so they apply to the whole link (both
shaped directions) whatever their `stream`; only toxicity 1 is accepted. Toxiproxy's
bandwidth rate is in KB/s of 1000 bytes (toxics/bandwidth.go: len * ms / rate). Its
`timeout` toxic drops data; here it is an outage that holds data until the toxic goes,
which is how a TCP stream experiences a dead link.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from mesh.hosts import allowed_hosts
from mesh.http import serve_http
from mesh.metrics import register_process
from netem.control_access import WriteGuard, check_bind
from netem.link_metrics import LinkCollector
from netem.params import LinkError, LinkParamError, LinkParams, shown
from netem.proxy import LinkProxy, ProxyConfig, ProxyStatistics, Route
from netem.shaper import LinkShaper
from netem.toxics import (
    REMOVALS,
    TOXICS,
    active_toxics,
    apply_link_update,
    new_toxic,
    params_view,
    toxic_update,
)

logger = logging.getLogger(__name__)

DEFAULT_CONTROL_PORT = 8474
MAX_BODY_BYTES = 64 * 1024

class LinkControlError(LinkError):
    """A control request that cannot be served; carries its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_body(request: Request) -> bytes:
    """The request body, refused past MAX_BODY_BYTES (no update needs more than a few)."""
    declared = request.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise LinkControlError(413, f"body is larger than {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as parts:
        async for part in parts:
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise LinkControlError(413, f"body is larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


async def _json_body(request: Request) -> object:
    body = await _read_body(request)
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise LinkParamError(f"body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        # msgspec decodes nested arrays recursively; a deep one must not become a 500.
        raise LinkParamError("body is nested too deeply") from exc


def _json(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


class _ControlApi:
    """The endpoints; state is the proxy (and its shaper) plus the toxics' chosen names."""

    def __init__(self, proxy: LinkProxy, name: str) -> None:
        self._proxy = proxy
        self._shaper = proxy.shaper
        self._name = name
        self._toxic_names: dict[str, tuple[str, str]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        register_process(self.registry)
        self.registry.register(LinkCollector(proxy.statistics, name))

    def _apply(self, update: object) -> None:
        params = apply_link_update(self._shaper.params, update)
        self._shaper.set_params(params)
        logger.info("link %s parameters now %s", self._name, params)

    async def get_link(self, request: Request) -> Response:
        stats = msgspec.to_builtins(self._proxy.statistics())
        return _json({"name": self._name, **params_view(self._shaper.params), "statistics": stats})

    async def post_link(self, request: Request) -> Response:
        self._apply(await _json_body(request))
        return await self.get_link(request)

    def _check_proxy(self, request: Request) -> None:
        if request.path_params["proxy"] != self._name:
            raise LinkControlError(404, f"proxy not found: {shown(request.path_params['proxy'])}")

    def _toxics(self) -> list[dict[str, Any]]:
        toxics = []
        for kind, attributes in active_toxics(self._shaper.params).items():
            name, stream = self._toxic_names.get(kind, (f"{kind}_downstream", "downstream"))
            toxic = {"name": name, "type": kind, "stream": stream, "toxicity": 1.0}
            toxics.append(toxic | {"attributes": attributes})
        return toxics

    def _find_toxic(self, request: Request) -> dict[str, Any]:
        self._check_proxy(request)
        wanted = request.path_params["toxic"]
        for toxic in self._toxics():
            if toxic["name"] == wanted:
                return toxic
        raise LinkControlError(404, f"toxic not found: {shown(wanted)}")

    def _proxy_view(self) -> dict[str, Any]:
        addresses = self._proxy.listen_addresses or [
            (route.listen_host, route.listen_port) for route in self._proxy.routes
        ]
        routes = [
            {"listen": f"{host}:{port}", "upstream": f"{r.upstream_host}:{r.upstream_port}"}
            for (host, port), r in zip(addresses, self._proxy.routes, strict=True)
        ]
        return {
            "name": self._name,
            **routes[0],
            "enabled": self._shaper.params.up,
            "toxics": self._toxics(),
            "routes": routes,
        }

    async def get_proxies(self, request: Request) -> Response:
        return _json({self._name: self._proxy_view()})

    async def proxy(self, request: Request) -> Response:
        self._check_proxy(request)
        if request.method == "POST":
            body = await _json_body(request)
            if not isinstance(body, dict) or set(body) - {"enabled", "name"}:
                raise LinkParamError(
                    f"only 'enabled' can change on a running link, got {shown(body)}"
                )
            if "enabled" in body:
                if not isinstance(body["enabled"], bool):
                    raise LinkParamError(
                        f"enabled must be true or false, got {shown(body['enabled'])}"
                    )
                self._apply({"up": body["enabled"]})
        return _json(self._proxy_view())

    async def toxics(self, request: Request) -> Response:
        self._check_proxy(request)
        if request.method == "GET":
            return _json(self._toxics())
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise LinkParamError(f"body must be a JSON object, got {shown(body)}")
        kind, stream, name = new_toxic(body)
        update = toxic_update(kind, body.get("attributes", {}), create=True)
        if kind in active_toxics(self._shaper.params):
            raise LinkControlError(409, f"toxic already exists: a {kind} toxic is active")
        if kind not in active_toxics(apply_link_update(self._shaper.params, update)):
            # Toxics are views of the link's parameters: one that changes nothing is none.
            raise LinkParamError(f"a {kind} toxic needs a non-zero {' or '.join(TOXICS[kind])}")
        self._apply(update)
        self._toxic_names[kind] = (name or f"{kind}_{stream}", stream)
        return _json(self._view_of(kind))

    def _view_of(self, kind: str) -> dict[str, Any]:
        """The toxic of this kind; with zero attributes when the last change removed it."""
        for toxic in self._toxics():
            if toxic["type"] == kind:
                return toxic
        name, stream = self._toxic_names.pop(kind, (f"{kind}_downstream", "downstream"))
        attributes = {attribute: 0.0 for attribute in TOXICS[kind]}
        return {"name": name, "type": kind, "stream": stream, "toxicity": 1.0} | {
            "attributes": attributes
        }

    async def toxic(self, request: Request) -> Response:
        toxic = self._find_toxic(request)
        if request.method == "DELETE":
            self._apply(REMOVALS[toxic["type"]])
            self._toxic_names.pop(toxic["type"], None)
            return Response(status_code=204)
        if request.method == "POST":
            body = await _json_body(request)
            attributes = body.get("attributes", {}) if isinstance(body, dict) else body
            self._apply(toxic_update(toxic["type"], attributes, create=False))
            toxic = self._view_of(toxic["type"])
        return _json(toxic)

    async def reset(self, request: Request) -> Response:
        self._apply({"up": True, **REMOVALS["latency"], "bandwidth_bps": None, "loss": 0.0})
        self._toxic_names.clear()
        return Response(status_code=204)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


async def _control_error(request: Request, exc: Exception) -> Response:
    status = exc.status if isinstance(exc, LinkControlError) else 400
    return _json({"error": str(exc), "status": status}, status)


def create_control_app(
    proxy: LinkProxy,
    *,
    name: str = "link",
    admin_token: str | None = None,
    loopback_only: bool = False,
    hosts: frozenset[str] | None = None,
) -> Starlette:
    """The control API of one link (its proxy and shaper), as a Starlette ASGI app.

    Requests pass `netem.control_access.WriteGuard`: with `hosts` their Host must name one
    of them (None: any); writes with `admin_token` need it as a Bearer token, and with
    `loopback_only` their Host must be a loopback name (serve_link sets it when the API is
    open on loopback).
    """
    api = _ControlApi(proxy, name)
    routes = [
        HttpRoute("/link", api.get_link, methods=["GET"]),
        HttpRoute("/link", api.post_link, methods=["POST"]),
        HttpRoute("/proxies", api.get_proxies, methods=["GET"]),
        HttpRoute("/proxies/{proxy}", api.proxy, methods=["GET", "POST"]),
        HttpRoute("/proxies/{proxy}/toxics", api.toxics, methods=["GET", "POST"]),
        HttpRoute("/proxies/{proxy}/toxics/{toxic}", api.toxic, methods=["GET", "POST", "DELETE"]),
        HttpRoute("/reset", api.reset, methods=["POST"]),
        HttpRoute("/metrics", api.metrics, methods=["GET"]),
    ]
    handlers = {LinkParamError: _control_error, LinkControlError: _control_error}
    guard = Middleware(WriteGuard, admin_token=admin_token, loopback_only=loopback_only,
                       hosts=hosts)
    return Starlette(routes=routes, exception_handlers=handlers, middleware=[guard])


class LinkEndpoints(msgspec.Struct, frozen=True):
    """Where a running link listens: one (host, port) per route, and the control API."""

    routes: list[tuple[str, int]]
    control: tuple[str, int]


async def _report_statistics(
    proxy: LinkProxy, on_stats: Callable[[ProxyStatistics], None], interval_s: float
) -> None:
    while True:
        await anyio.sleep(interval_s)
        on_stats(proxy.statistics())


async def serve_link(
    routes: Sequence[Route],
    params: LinkParams,
    control_port: int = DEFAULT_CONTROL_PORT,
    *,
    control_host: str = "127.0.0.1",
    control_names: Sequence[str] = (),
    admin_token: str | None = None,
    name: str = "link",
    seed: int = 0,
    shape_ingress: bool = True,
    config: ProxyConfig | None = None,
    on_stats: Callable[[ProxyStatistics], None] | None = None,
    stats_interval_s: float = 1.0,
    task_status: TaskStatus[LinkEndpoints] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the `link` service until cancelled: the proxy and its control API, one task group.

    `on_stats` is called with `ProxyStatistics` every `stats_interval_s` (the event bus hook).
    Port 0 binds ephemeral ports; the bound addresses are reported through `task_status`.
    The control API's writes need `Authorization: Bearer <admin_token>` when a token is
    given; a `control_host` beyond loopback without one is refused here, before binding.
    Every request's Host must name `control_host`, one of `control_names` (where others dial
    the API) or loopback (any, when it binds every address: the token guards it there).
    """
    check_bind(control_host, admin_token)
    shaper = LinkShaper(
        params, anyio.current_time, random.Random(seed), shape_ingress=shape_ingress
    )
    proxy = LinkProxy(routes, shaper, config)
    app = create_control_app(
        proxy, name=name, admin_token=admin_token, loopback_only=admin_token is None,
        hosts=allowed_hosts(control_host, *control_names),
    )
    async with anyio.create_task_group() as tg:
        route_addresses = await tg.start(proxy.run)
        control = await tg.start(partial(serve_http, app, control_host, control_port,
                                         log_name="netem.control.http"))
        if on_stats is not None:
            tg.start_soon(_report_statistics, proxy, on_stats, stats_interval_s)
        task_status.started(LinkEndpoints(route_addresses, control))
