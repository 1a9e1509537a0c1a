"""Controls: what the page may change, validated here and forwarded to the services.

The browser talks only to the dashboard's origin; the dashboard forwards each request to the
service that owns the setting (the link's control API, the router's admin API), so the page
needs no CORS and no knowledge of addresses. The services' JSON answers pass through as they are.

Contracts (docs/architecture.md section 4): link control API at the topology's link address, e.g.
http://127.0.0.1:8474 (netem/control.py: GET /link, POST /link partial update); router admin
API, e.g. http://127.0.0.1:8000 (POST /admin/policy, /admin/threshold, /admin/workload,
/admin/workers/{name}/role, /admin/workers/{name}/drain; GET /admin/state); the supervisor's
control API of `prfaas up` (services/cli/supervisor_api.py: GET /processes, POST
/processes/{name}/kill, /processes/{name}/restart). Every call carries the run's admin token
(`Authorization: Bearer TOKEN`, services/contract/access.py) when the dashboard has one. A
simulation implements the same protocol on its world (services/sim/controls.py), plus the
speed of its virtual time.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Protocol

import httpx
import msgspec

from mesh.http import CLIENT_KEEPALIVE_S
from services.contract.access import bearer_headers
from ui.errors import ControlError

JsonObject = dict[str, Any]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
_WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class LinkUpdate(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A partial change of the link (the link API's units); unset fields stay as they are."""

    bandwidth_bps: NonNegative | msgspec.UnsetType | None = msgspec.UNSET  # None or 0: unshaped
    delay_ms: NonNegative | msgspec.UnsetType = msgspec.UNSET
    jitter_ms: NonNegative | msgspec.UnsetType = msgspec.UNSET
    loss: Annotated[float, msgspec.Meta(ge=0, le=1)] | msgspec.UnsetType = msgspec.UNSET
    up: bool | msgspec.UnsetType = msgspec.UNSET


class PolicyRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ThresholdRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    t: NonNegative | None  # tokens; None clears the override


class WorkloadRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    action: Literal["start", "stop"]
    rate: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 2.0  # requests per second
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=32)] = "mixed"


class RoleRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["prefill", "decode"]


class SpeedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Virtual seconds per wall second: for a simulation (a live mesh runs in real time)."""

    speed: Annotated[float, msgspec.Meta(gt=0, le=100_000)]


def check_worker_name(name: str) -> str:
    if not _WORKER_NAME.fullmatch(name):
        raise ControlError(400, f"worker must be a plain name ([A-Za-z0-9._-]), got {name!r}")
    return name


class ControlClient(Protocol):
    """What the dashboard can ask of the mesh; every method answers the service's JSON."""

    async def state(self) -> JsonObject:
        """{"link": GET /link or None, "router": GET /admin/state or None, "errors": {...}},
        and from a simulation "sim": {"speed", "achieved", "virtual_s", ...}."""
        ...

    async def update_link(self, update: LinkUpdate) -> JsonObject: ...

    async def set_policy(self, request: PolicyRequest) -> JsonObject: ...

    async def set_threshold(self, request: ThresholdRequest) -> JsonObject: ...

    async def workload(self, request: WorkloadRequest) -> JsonObject: ...

    async def set_role(self, worker: str, request: RoleRequest) -> JsonObject: ...

    async def drain(self, worker: str) -> JsonObject: ...

    async def set_speed(self, request: SpeedRequest) -> JsonObject:
        """A simulation's pace; a real mesh refuses (409)."""
        ...

    async def processes(self) -> JsonObject:
        """The supervisor's GET /processes: {"processes": [...], "stopping": bool}."""
        ...

    async def kill(self, process: str) -> JsonObject: ...

    async def restart(self, process: str) -> JsonObject: ...

    async def aclose(self) -> None: ...


def _answer(service: str, response: httpx.Response) -> JsonObject:
    if response.status_code >= 400:
        raise ControlError(response.status_code, f"{service}: {_error_text(response)}")
    if not response.content:
        return {}
    try:
        body = msgspec.json.decode(response.content)
    except msgspec.DecodeError as exc:
        raise ControlError(502, f"{service} answered with invalid JSON: {exc}") from exc
    return body if isinstance(body, dict) else {"result": body}


def _error_text(response: httpx.Response) -> str:
    try:
        body = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return f"HTTP {response.status_code}: {response.text[:200]}"


class HttpControlClient:
    """Forwards controls over HTTP; a missing client (None) answers 503 for its service."""

    def __init__(self, link: httpx.AsyncClient | None, router: httpx.AsyncClient | None,
                 supervisor: httpx.AsyncClient | None = None) -> None:
        self._clients = {"link": link, "router": router, "supervisor": supervisor}

    @classmethod
    def connect(
        cls, link_url: str | None, router_url: str | None, *, supervisor_url: str | None = None,
        token: str | None = None, timeout_s: float = 3.0,
    ) -> HttpControlClient:
        """Clients for the given base URLs (the topology's addresses); None: not available.
        Each sends `token` (the run's admin token) when one is given."""
        headers = bearer_headers(token)

        def client(url: str | None) -> httpx.AsyncClient | None:
            if url is None:
                return None
            return httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=headers,
                                     limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))

        return cls(client(link_url), client(router_url), client(supervisor_url))

    async def _call(self, service: str, method: str, path: str, body: object = None) -> JsonObject:
        client = self._clients[service]
        if client is None:
            raise ControlError(503, f"{service}: no {service} is configured for this dashboard")
        content = None if body is None else msgspec.json.encode(body)
        headers = {"content-type": "application/json"} if content is not None else {}
        try:
            response = await client.request(method, path, content=content, headers=headers)
        except httpx.HTTPError as exc:
            raise ControlError(502, f"{service} at {client.base_url} unreachable: {exc!r}") from exc
        return _answer(service, response)

    async def state(self) -> JsonObject:
        result: JsonObject = {"link": None, "router": None, "errors": {}}
        for service, path in (("link", "/link"), ("router", "/admin/state")):
            try:
                result[service] = await self._call(service, "GET", path)
            except ControlError as exc:
                result["errors"][service] = str(exc)
        return result

    async def update_link(self, update: LinkUpdate) -> JsonObject:
        return await self._call("link", "POST", "/link", update)

    async def set_policy(self, request: PolicyRequest) -> JsonObject:
        return await self._call("router", "POST", "/admin/policy", request)

    async def set_threshold(self, request: ThresholdRequest) -> JsonObject:
        return await self._call("router", "POST", "/admin/threshold", request)

    async def workload(self, request: WorkloadRequest) -> JsonObject:
        return await self._call("router", "POST", "/admin/workload", request)

    async def set_role(self, worker: str, request: RoleRequest) -> JsonObject:
        path = f"/admin/workers/{check_worker_name(worker)}/role"
        return await self._call("router", "POST", path, request)

    async def drain(self, worker: str) -> JsonObject:
        path = f"/admin/workers/{check_worker_name(worker)}/drain"
        return await self._call("router", "POST", path, {})

    async def set_speed(self, request: SpeedRequest) -> JsonObject:
        raise ControlError(409, "speed: a live mesh runs in real time (speed is for the "
                                "simulation: prfaas sim-dashboard)")
    async def processes(self) -> JsonObject:
        # Not run by `prfaas up` (tests, `prfaas serve ui` alone): nothing to show, no error.
        if self._clients["supervisor"] is None:
            return {"processes": [], "stopping": False, "supervised": False}
        return await self._call("supervisor", "GET", "/processes")

    async def kill(self, process: str) -> JsonObject:
        path = f"/processes/{check_worker_name(process)}/kill"
        return await self._call("supervisor", "POST", path, {"signal": "KILL"})

    async def restart(self, process: str) -> JsonObject:
        path = f"/processes/{check_worker_name(process)}/restart"
        return await self._call("supervisor", "POST", path, {})

    async def aclose(self) -> None:
        for client in self._clients.values():
            if client is not None:
                await client.aclose()
