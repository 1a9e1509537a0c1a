"""The event loops the mesh's own tests run on (not a test module): trio, asyncio on uvloop
(the live default) and, where a module asks for it, plain asyncio. A module takes them with
`anyio_backend = backends_fixture()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

Backend = tuple[str, dict[str, Any]]


def backends_fixture(*, plain_asyncio: bool = False) -> Callable[..., Backend]:
    """anyio's `anyio_backend` fixture over trio and uvloop (and plain asyncio if asked)."""
    params = [pytest.param(("trio", {}), id="trio"),
              pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
    if plain_asyncio:
        params.append(pytest.param(("asyncio", {}), id="asyncio"))

    @pytest.fixture(params=params, name="anyio_backend")
    def anyio_backend(request: pytest.FixtureRequest) -> Backend:
        backend: Backend = request.param
        return backend

    return anyio_backend
