"""The supervisor's control API: loopback only, admin token honoured, no foreign origins.

    GET  /processes                  {"processes": [ProcessStatus...], "stopping": bool}
    GET  /processes/{name}           one ProcessStatus: name, state (starting, up, down,
                                     restarting, stopped), pid, restarts, deaths, since,
                                     last_exit
    POST /processes/{name}/kill      {"signal": "KILL"|"TERM"|"INT"} (default KILL): a crash,
                                     restarted after the backoff like any death;
                                     "STOP"|"CONT": frozen (alive, silent: a hung host) and
                                     woken again, no death
    POST /processes/{name}/restart   a planned stop and an immediate start

Errors answer `{"error": message, "status": code}`, as the other admin APIs do. The
dashboard (ui/controls.py) proxies its kill and restart buttons here, with the token.
"""

from __future__ import annotations

import signal
from typing import Literal

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.cli.supervisor import Supervisor, SupervisorError
from services.contract.access import SUPERVISOR_URL_ENV, check_admin

__all__ = ["SUPERVISOR_URL_ENV", "supervisor_app"]
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT,
           "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT}


class KillBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    signal: Literal["KILL", "TERM", "INT", "STOP", "CONT"] = "KILL"


def _json(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


class _Api:
    def __init__(self, supervisor: Supervisor, token: str | None,
                 hosts: frozenset[str] | None) -> None:
        self.supervisor, self.token, self.hosts = supervisor, token, hosts

    def _check(self, request: Request) -> None:
        own = f"{request.url.scheme}://{request.url.netloc}"
        refusal = check_admin(request.headers, self.token, own, self.hosts)
        if refusal is not None:
            raise SupervisorError(refusal.status, refusal.message)

    async def processes(self, request: Request) -> Response:
        self._check(request)
        return _json(self.supervisor.statistics())

    async def process(self, request: Request) -> Response:
        self._check(request)
        return _json(self.supervisor.child(request.path_params["name"]).status())

    async def kill(self, request: Request) -> Response:
        self._check(request)
        try:
            body = msgspec.json.decode(await request.body() or b"{}", type=KillBody)
        except msgspec.DecodeError as exc:
            raise SupervisorError(400, f"bad kill body: {exc}") from exc
        name = request.path_params["name"]
        return _json(await self.supervisor.kill(name, SIGNALS[body.signal]))

    async def restart(self, request: Request) -> Response:
        self._check(request)
        return _json(await self.supervisor.restart(request.path_params["name"]))


async def _error(request: Request, exc: Exception) -> Response:
    status = exc.status if isinstance(exc, SupervisorError) else 500
    return _json({"error": str(exc), "status": status}, status)


def supervisor_app(supervisor: Supervisor, token: str | None,
                   hosts: frozenset[str] | None = None) -> Starlette:
    """The control API; `hosts`: the Host names it answers (allowed_hosts; None: any)."""
    api = _Api(supervisor, token, hosts)
    routes = [
        Route("/processes", api.processes, methods=["GET"]),
        Route("/processes/{name}", api.process, methods=["GET"]),
        Route("/processes/{name}/kill", api.kill, methods=["POST"]),
        Route("/processes/{name}/restart", api.restart, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={SupervisorError: _error})
