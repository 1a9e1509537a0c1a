"""Who may change the mesh: the admin token and the Origin rule, shared by every admin API;
and who may join it: the mesh's shared secret.

One token per run (`prfaas up` generates it and passes it to every child in
PRFAAS_ADMIN_TOKEN): the router's `/admin/*` routes, the supervisor's control API and the
dashboard's calls to both carry it as `Authorization: Bearer TOKEN`. A service bound beyond
loopback refuses to start without one; on loopback it is optional but honoured when set.

The Origin rule stops a web page from driving an admin API through the browser of someone
on the machine (cross-site request forgery): a request that carries an Origin header must
come from the API's own origin. Server-side callers (the dashboard's proxy, curl) send none.
The Host rule stops DNS rebinding (a page whose name is made to resolve to 127.0.0.1 is
same-origin with itself, so the Origin rule passes it): the request's Host must name the API
(a loopback name, its bind address or the address it is dialled at), whatever the port.

The mesh's secret (mesh.membership: every connection proves it in its handshake) comes from
where the topology's `[mesh]` section says, else from PRFAAS_MESH_SECRET; `prfaas up`
generates one per run when neither gives one. Without one a service listens on loopback only.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import msgspec

from mesh.errors import ConfigError
from mesh.hosts import host_allowed
from mesh.membership import check_secret, is_loopback
from mesh.topology import Topology, mesh_secret

TOKEN_ENV = "PRFAAS_ADMIN_TOKEN"
# A shorter token is refused: it could be guessed (netem's control API holds the same rule).
MIN_TOKEN = 16
# The mesh's secret when the topology's [mesh] section names no source of its own.
MESH_SECRET_ENV = "PRFAAS_MESH_SECRET"
# Where the supervisor's control API listens (`prfaas up` sets it for its children).
SUPERVISOR_URL_ENV = "PRFAAS_SUPERVISOR_URL"
AUTHORIZATION = "authorization"
# Addresses a server binds to that are no address to dial: the service's host is.


class Refusal(msgspec.Struct, frozen=True):
    """Why an admin request is refused: 401 (no or wrong token) or 403 (foreign origin)."""

    status: int
    message: str


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The run's admin token, or None when none is set (an empty value counts as none);
    ConfigError when it is shorter than MIN_TOKEN or not one word of printable ASCII."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    if value and len(value) < MIN_TOKEN:
        # Not echoed: the message would put the token into logs.
        raise ConfigError(f"{TOKEN_ENV} must be at least {MIN_TOKEN} characters, got "
                          f"{len(value)}")
    if value and not (value.isascii() and value.isprintable() and " " not in value):
        # A bearer credential is one word of printable ASCII.
        raise ConfigError(f"{TOKEN_ENV} must be printable ASCII without spaces")
    return value or None


def service_secret(topology: Topology, environ: Mapping[str, str] | None = None
                   ) -> bytes | None:
    """The mesh's secret: the topology's (`[mesh]`), else MESH_SECRET_ENV's, else None."""
    environ = os.environ if environ is None else environ
    if topology.mesh.configured:
        return mesh_secret(topology, environ)
    value = environ.get(MESH_SECRET_ENV, "")
    return check_secret(value.encode()) if value else None


def require_token_beyond_loopback(host: str, token: str | None, what: str) -> None:
    """Refuses to serve an admin API on a non-loopback address without a token."""
    if token is None and not is_loopback(host):
        raise ConfigError(f"{what} binds {host}, beyond loopback: set {TOKEN_ENV} (an admin "
                          f"token) or bind 127.0.0.1")


def bearer_headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {AUTHORIZATION: f"Bearer {token}"}


def check_admin(headers: Mapping[str, str], token: str | None, own_origin: str,
                hosts: frozenset[str] | None = None) -> Refusal | None:
    """None when the request may act; else why not. `headers` keys are lower case; `hosts`:
    the Host names the API answers (allowed_hosts; None: any)."""
    if not host_allowed(headers.get("host"), hosts):
        return Refusal(403, f"Host {headers.get('host')!r} is not this API's (DNS rebinding?)")
    origin = headers.get("origin")
    if origin is not None and origin != own_origin:
        return Refusal(403, f"cross-origin admin request from {origin!r} refused")
    if token is None:
        return None
    given = headers.get(AUTHORIZATION, "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not value:
        return Refusal(401, "admin token required (Authorization: Bearer TOKEN)")
    if not hmac.compare_digest(value.encode(), token.encode()):
        return Refusal(401, "wrong admin token")
    return None
