"""mesh.http: request bodies over the bound are refused before the app reads them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mesh.http import serve_http

LIMIT = 1000


async def body_length(request: Request) -> JSONResponse:
    return JSONResponse({"read": len(await request.body())})


APP = Starlette(routes=[Route("/", body_length, methods=["POST"])])


@pytest.mark.trio
async def test_a_body_over_the_bound_is_refused_before_the_app_reads_it() -> None:
    async with anyio.create_task_group() as tasks:
        host, port = await tasks.start(lambda task_status: serve_http(
            APP, "127.0.0.1", 0, max_body_bytes=LIMIT, task_status=task_status))
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as client:
            within = await client.post("/", content=b"x" * LIMIT)
            assert within.status_code == 200 and within.json() == {"read": LIMIT}
            over = await client.post("/", content=b"x" * (LIMIT + 1))
            assert over.status_code == 413 and over.json()["status"] == 413

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(3):
                    yield b"x" * LIMIT

            unstated = await client.post("/", content=chunks())
            assert unstated.status_code == 411
        tasks.cancel_scope.cancel()
