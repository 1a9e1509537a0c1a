"""Membership: proving, in the Hello exchange, that both ends hold the mesh's shared secret.

Each side sends a fresh random nonce in its Hello. The server's Hello carries its proof, an
HMAC-SHA256 under the secret over both nonces and both names; the client checks it, then
sends its own proof in a `Proof` frame right after (no extra round trip: its first requests
follow on the same stream). The role label differs per direction, so a proof cannot be
reflected back, and the server's nonce is fresh per connection, so a proof recorded on one
connection fails on any other. Proofs are compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from mesh.errors import ConfigError

NONCE_SIZE = 32
MIN_SECRET = 16
_LABEL = b"mesh-membership-v2"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def check_secret(secret: bytes | None) -> bytes | None:
    """The secret unchanged, or ConfigError when it is too short to resist guessing."""
    if secret is None:
        return None
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET:
        raise ConfigError(f"mesh secret must be bytes of at least {MIN_SECRET}, got a shorter one")
    return secret


def _field(value: bytes) -> bytes:
    # Length-prefixed, so no two different field lists hash the same bytes.
    return len(value).to_bytes(4, "big") + value


def proof(
    secret: bytes, role: str, client: str, server: str, client_nonce: bytes, server_nonce: bytes
) -> bytes:
    """The MAC that `role` ("client" or "server") sends for this pair of Hellos."""
    fields = (_LABEL, role.encode(), client.encode(), server.encode(), client_nonce, server_nonce)
    return hmac.new(secret, b"".join(map(_field, fields)), hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of a received proof with the one it should be."""
    return hmac.compare_digest(expected, got)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (a loopback address or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_beyond_loopback(host: str, secret: bytes | None) -> None:
    """ConfigError when a listener on a non-loopback host would run without a secret."""
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"listening on {host!r} beyond loopback needs a mesh secret (none is configured)"
        )
