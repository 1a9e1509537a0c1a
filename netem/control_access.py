"""Who may read and change the link through its control API: an ASGI guard in front of it.

Every request, reads included, is refused 403 when its `Host` names none of the API's own
names (services.contract.access.allowed_hosts: the loopback names, where it binds, where it
is dialled): a page whose DNS name was rebound to the API's address would otherwise read it
and, same-origin with itself, write it. Beyond that, reads (GET, HEAD) stay open: they are
what dashboards and Prometheus poll. A write (POST, PUT, PATCH, DELETE) is refused

- 403 when it carries an `Origin` other than the API's own: a page elsewhere (for instance
  http://evil.example posting `text/plain`, which needs no CORS preflight) must not steer
  the link through a browser that can reach it;
- 403 when the API is open on loopback and the `Host` header names anything but a loopback
  address: a DNS-rebound name would otherwise make the page same-origin;
- 401 without `Authorization: Bearer <token>` when an admin token is configured;
- 415 when it has a body that is not `application/json`.

`check_bind` is the start-up rule: beyond loopback the API needs a token.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

import msgspec
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from mesh.hosts import host_allowed
from netem.params import LinkParamError, shown

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; any other name may resolve anywhere."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_token(admin_token: str | None) -> None:
    """Raise LinkParamError unless the token is None or usable in a Bearer header."""
    if admin_token is None:
        return
    if not isinstance(admin_token, str) or not admin_token.isascii():
        raise LinkParamError(f"admin_token must be an ASCII string, got {shown(admin_token)}")
    if len(admin_token) < 16 or not admin_token.isprintable() or " " in admin_token:
        # Not echoed: the message would put (most of) the secret into logs.
        raise LinkParamError("admin_token must be at least 16 printable characters, no spaces")


def check_bind(control_host: str, admin_token: str | None) -> None:
    """The start-up rule: a control API reachable beyond loopback must have a token."""
    check_token(admin_token)
    if admin_token is None and not is_loopback(control_host):
        raise LinkParamError(
            f"control_host {control_host!r} is reachable beyond loopback: "
            "set admin_token (writes then need 'Authorization: Bearer <token>') "
            "or bind 127.0.0.1"
        )


def _origin_key(scheme: str, netloc: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port made explicit."""
    parts = urlsplit(f"{scheme}://{netloc}")
    try:
        port = parts.port
    except ValueError:
        port = -1  # an unparseable port matches nothing
    return scheme.lower(), (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """Whether a browser's `Origin` is the API's own (its scheme and `Host`)."""
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc or parts.path not in ("", "/"):
        return False  # "null" (sandboxed pages, file://) and anything malformed
    theirs = _origin_key(parts.scheme, parts.netloc)
    return theirs == _origin_key(scheme, host_header)


def _bearer_matches(authorization: str, admin_token: str) -> bool:
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Constant time: the comparison must not tell a caller how much of a guess was right.
    return hmac.compare_digest(credentials.strip().encode(), admin_token.encode())


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in (
        "",
        "0",
    )


class WriteGuard:
    """ASGI middleware: refuses requests as the module says, before any handler runs.
    `hosts`: the Host names the API answers (None: any)."""

    def __init__(self, app: ASGIApp, *, admin_token: str | None, loopback_only: bool,
                 hosts: frozenset[str] | None = None) -> None:
        check_token(admin_token)
        self._app = app
        self._token = admin_token
        self._loopback_only = loopback_only
        self._hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await _refuse(send, *refusal)
                return
        await self._app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, reason) when this request must be refused, else None."""
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not host_allowed(host, self._hosts):
            return 403, f"Host {shown(host)} is not this API's (DNS rebinding?)"
        if scope["method"] not in _WRITES:
            return None
        if self._loopback_only and not is_loopback(_origin_key("http", host)[1]):
            return 403, f"Host {shown(host)} is not a loopback name; this API is local only"
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, scope.get("scheme", "http"), host):
            return 403, f"cross-origin write refused (Origin {shown(origin)})"
        if self._token is not None and not _bearer_matches(
            headers.get("authorization", ""), self._token
        ):
            return 401, "this control API needs 'Authorization: Bearer <admin token>' to write"
        if _has_body(headers) and not _is_json(headers.get("content-type", "")):
            return 415, f"body must be application/json, got {shown(headers.get('content-type'))}"
        return None


async def _refuse(send: Send, status: int, message: str) -> None:
    body = msgspec.json.encode({"error": message, "status": status})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="link"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
