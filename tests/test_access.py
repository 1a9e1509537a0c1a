"""services.contract.access: where the mesh's secret comes from."""

from __future__ import annotations

import pytest

from mesh.errors import ConfigError
from mesh.topology import parse_topology
from services.contract.access import (
    MESH_SECRET_ENV,
    MIN_TOKEN,
    TOKEN_ENV,
    service_secret,
    token_from_env,
)

SECRET = "a mesh secret of 32 characters.."


def test_the_mesh_secret_comes_from_the_topology_else_the_environment() -> None:
    bare = parse_topology("")
    assert service_secret(bare, {}) is None
    assert service_secret(bare, {MESH_SECRET_ENV: SECRET}) == SECRET.encode()
    named = parse_topology('[mesh]\nsecret_env = "MY_SECRET"\n')
    # The topology's own source wins: the default variable is not a fallback for it.
    assert service_secret(named, {"MY_SECRET": SECRET[::-1], MESH_SECRET_ENV: SECRET}) == \
        SECRET[::-1].encode()
    with pytest.raises(ConfigError, match="'MY_SECRET' is not set"):
        service_secret(named, {MESH_SECRET_ENV: SECRET})
    with pytest.raises(ConfigError, match="at least 16"):
        service_secret(bare, {MESH_SECRET_ENV: "short"})


def test_an_admin_token_shorter_than_16_characters_is_refused() -> None:
    assert token_from_env({}) is None and token_from_env({TOKEN_ENV: ""}) is None
    assert token_from_env({TOKEN_ENV: "x" * MIN_TOKEN}) == "x" * MIN_TOKEN
    with pytest.raises(ConfigError, match=f"{TOKEN_ENV} must be at least 16 characters, got 15"):
        token_from_env({TOKEN_ENV: "y" * 15})
    with pytest.raises(ConfigError, match="printable ASCII without spaces"):
        token_from_env({TOKEN_ENV: "two words, long enough"})
