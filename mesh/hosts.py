"""Which `Host` names an HTTP API answers: the defence against DNS rebinding.

A page on another site can make a browser resolve its own name to 127.0.0.1 (or to an address
on the operator's network) and then talk to an API there as if same-origin. The browser still
sends the page's name in `Host`, so an API that answers only the names it is known by (its
loopback names, the address it listens on, the names it is dialled at) refuses it. An API that
listens on every address cannot list its names: there the admin token is its guard.
"""

from __future__ import annotations

from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(bind: str, *names: str) -> frozenset[str] | None:
    """The Host names an HTTP API bound to `bind` answers: the loopback names, `bind` and
    `names` (where it is dialled). None (any) when it binds every address: beyond loopback
    the admin token, required there, is its guard."""
    if bind in WILDCARD_HOSTS:
        return None
    named = {name.lower() for name in names if name not in WILDCARD_HOSTS}
    return LOOPBACK_NAMES | {bind.lower()} | named


def host_allowed(host: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a request's Host header (any port) names one of `allowed` (None: any)."""
    if allowed is None:
        return True
    try:
        name = urlsplit(f"//{host}").hostname if host else None
    except ValueError:
        return False
    return name in allowed
