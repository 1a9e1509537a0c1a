"""The dashboard's guards: who may read it at all (`AccessGuard`), and that every POST comes
from its own page (`CsrfGuard`).

`AccessGuard`, in front of everything: the request's Host must be one of the dashboard's own
names (mesh.hosts.allowed_hosts: a page whose name was rebound to 127.0.0.1 is
refused), and with an admin token (required when the dashboard listens beyond loopback) every
request must carry it: `Authorization: Bearer TOKEN`, or the cookie that opening
`/?token=TOKEN` once sets (HttpOnly, SameSite=Strict: the page's own fetches and event
stream send it, other sites' pages do not).

Two checks on every request that may change something (any method but GET, HEAD, OPTIONS):
the Origin header, when present, must be the dashboard's own origin (scheme://host:port as
the request addressed it), and the `x-csrf-token` header must carry the token the page was
served with (a `<meta name="csrf-token">`, read by ui/static/util.js). A foreign page can
send a POST (a form or a text/plain fetch needs no CORS preflight) but can read neither the
token nor forge the Origin, so both fail with 403 before any control runs.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

import msgspec
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from mesh.hosts import allowed_hosts, host_allowed
from mesh.membership import is_loopback

CSRF_HEADER = "x-csrf-token"
TOKEN_COOKIE = "prfaas_admin_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def refusal(headers: Headers, scheme: str, token: str) -> str | None:
    """Why a state-changing request is refused, or None."""
    host = headers.get("host", "")
    origin = headers.get("origin")
    if origin is not None and origin != f"{scheme}://{host}":
        return f"cross-origin request from {origin!r} refused"
    if not hmac.compare_digest(headers.get(CSRF_HEADER, "").encode(), token.encode()):
        return f"missing or wrong {CSRF_HEADER} header (reload the page)"
    return None


class CsrfGuard:
    """ASGI middleware: 403 `{"error", "status"}` for a POST that fails `refusal`."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            why = refusal(Headers(scope=scope), scope.get("scheme", "http"), self.token)
            if why is not None:
                await _forbid(send, why)
                return
        await self.app(scope, receive, send)


class AccessGuard:
    """ASGI middleware: 403 for a foreign Host, 401 without the admin token (when one is
    set); `/?token=TOKEN` with the right token sets the cookie and redirects to `/`."""

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str] | None, token: str | None
                 ) -> None:
        self.app, self.hosts, self.token = app, hosts, token

    @classmethod
    def listening_on(cls, app: ASGIApp, host: str, names: tuple[str, ...],
                     token: str | None) -> AccessGuard:
        """The guard of a dashboard bound to `host` and dialled at `names`: their Host names
        only, and beyond loopback `token` on every request (on loopback it asks none)."""
        return cls(app, hosts=allowed_hosts(host, *names),
                   token=None if is_loopback(host) else token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not host_allowed(headers.get("host"), self.hosts):
            await _forbid(send, f"Host {headers.get('host')!r} is not this dashboard's "
                                "(DNS rebinding?)")
            return
        if self.token is not None:
            offered = self._offered(scope)
            if offered is not None and hmac.compare_digest(offered.encode(),
                                                           self.token.encode()):
                await _remember(send, self.token)
                return
            if not self._carries_token(headers):
                await _forbid(send, "admin token required: open /?token=TOKEN once, or send "
                                    "Authorization: Bearer TOKEN", 401)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _offered(scope: Scope) -> str | None:
        raw: bytes = scope.get("query_string", b"")
        offered = parse_qs(raw.decode("latin-1")).get("token", [])
        return offered[0] if offered else None

    def _carries_token(self, headers: Headers) -> bool:
        assert self.token is not None
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        cookie = cookie_parser(headers.get("cookie", "")).get(TOKEN_COOKIE, "")
        given = bearer if scheme.lower() == "bearer" and bearer else cookie
        return hmac.compare_digest(given.encode(), self.token.encode())


async def _remember(send: Send, token: str) -> None:
    """303 to `/`, setting the token's cookie (so the token leaves the address bar)."""
    cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", b"/"), (b"set-cookie", cookie.encode()),
                            (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


async def _forbid(send: Send, message: str, status: int = 403) -> None:
    body = msgspec.json.encode({"error": message, "status": status})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
