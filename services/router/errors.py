"""The router's one exception tree: each error maps to an HTTP status and an OpenAI error body.

A bad request fails that request only, never the router; messages name the parameter and the
bad value. The OpenAI API answers `{"error": {"message", "type", "param", "code"}}`; the admin
API (services/router/openai.py) answers `{"error": message, "status": code}` from the same errors.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class RouterError(Exception):
    """Base of the router's errors; each maps to one HTTP status and an OpenAI error body."""

    status: ClassVar[int] = 500
    kind: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorDetail(self.message, self.kind, self.param, self.code))

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries besides the body."""
        return {}


class InvalidRequest(RouterError):
    status, kind = 400, "invalid_request_error"


class ContextTooLong(InvalidRequest):
    """The prompt (plus max_tokens) does not fit the model's context."""


class NotFound(RouterError):
    status, kind = 404, "not_found_error"


class Conflict(RouterError):
    status, kind = 409, "conflict_error"


class QueueFull(RouterError):
    """Admission is full: answered at once, with when to try again."""

    status, kind = 429, "rate_limit_error"
    retry_after_s: ClassVar[int] = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NoWorkerAvailable(RouterError):
    status, kind = 503, "service_unavailable"


class UpstreamFailed(RouterError):
    """A worker or the cache directory failed while serving an admitted request."""

    status, kind = 502, "upstream_error"


class DataPathBroken(UpstreamFailed):
    """A placed request's data path broke (services/router/runner.py `drive`): the message is
    the first error either side met; `prefill` and `decode` hold what each side met (the mesh
    error, or the UpstreamFailed of a broken protocol), None for a side that met nothing. The
    request runner reads them to decide whether and where the request continues."""

    def __init__(self, message: str, *, prefill: Exception | None,
                 decode: Exception | None) -> None:
        super().__init__(message)
        self.prefill, self.decode = prefill, decode


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorDetail
