"""The dashboard's guard against cross-site requests: every POST must come from its own page.

Two checks on every request that may change something (any method but GET, HEAD, OPTIONS):
the Origin header, when present, must be the dashboard's own origin (scheme://host:port as
the request addressed it), and the `x-csrf-token` header must carry the token the page was
served with (a `<meta name="csrf-token">`, read by ui/static/util.js). A foreign page can
send a POST (a form or a text/plain fetch needs no CORS preflight) but can read neither the
token nor forge the Origin, so both fail with 403 before any control runs.
"""

from __future__ import annotations

import hmac

import msgspec
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

CSRF_HEADER = "x-csrf-token"
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


async def _forbid(send: Send, message: str) -> None:
    body = msgspec.json.encode({"error": message, "status": 403})
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
