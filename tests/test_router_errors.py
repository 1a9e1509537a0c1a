"""The router's error tree: one HTTP status and one OpenAI error body per kind."""

from __future__ import annotations

import msgspec
import pytest

from services.router.errors import (
    Conflict,
    ContextTooLong,
    InvalidRequest,
    NotFound,
    NoWorkerAvailable,
    QueueFull,
    RouterError,
    UpstreamFailed,
)


@pytest.mark.parametrize(("kind", "status", "type_"), [
    (RouterError, 500, "server_error"), (InvalidRequest, 400, "invalid_request_error"),
    (ContextTooLong, 400, "invalid_request_error"), (NotFound, 404, "not_found_error"),
    (Conflict, 409, "conflict_error"), (QueueFull, 429, "rate_limit_error"),
    (NoWorkerAvailable, 503, "service_unavailable"), (UpstreamFailed, 502, "upstream_error"),
])
def test_each_error_has_its_status_and_openai_body(kind: type[RouterError], status: int,
                                                   type_: str) -> None:
    error = kind("bad max_tokens, got -1", param="max_tokens", code="c")
    assert isinstance(error, RouterError) and error.status == status
    body = msgspec.json.decode(msgspec.json.encode(error.body()))
    assert body == {"error": {"message": "bad max_tokens, got -1", "type": type_,
                              "param": "max_tokens", "code": "c"}}
