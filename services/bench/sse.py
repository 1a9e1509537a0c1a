"""Server-sent events as OpenAI streams them, and what one streamed chunk says.

`SSEDecoder` follows the WHATWG event-stream rules that matter here: lines end in LF, CRLF or
CR (even split across network chunks); `data:` lines accumulate (joined by LF) until a blank
line dispatches the event; a leading space after the colon is dropped; lines starting with
a colon are comments; unknown fields are ignored. At end of stream a pending event is
dispatched (lenient: some servers omit the final blank line).

`read_chunk` reads one OpenAI streaming JSON object, completions (`choices[0].text`) or
chat (`choices[0].delta.content`), plus `usage` and the router's `prfaas` field
({"cluster": ..., "cached_tokens": ...}, normally on the final chunk). Absent fields are None.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.bench.errors import BenchError

DONE = "[DONE]"


class SSEEvent(msgspec.Struct, frozen=True):
    data: str
    event: str = "message"
    id: str = ""


class SSEDecoder:
    """Incremental decoder: feed text as it arrives, get complete events back."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._event = ""
        self._id = ""
        self._pending_cr = False

    def feed(self, text: str) -> list[SSEEvent]:
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across two chunks
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()
        events = []
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: the last line and a pending event, if any."""
        events = self.feed("\n") if self._buffer else []
        if self._data:
            events.append(self._dispatch())
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if self._data:
                return self._dispatch()
            self._reset()
            return None
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            self._id = value
        return None

    def _reset(self) -> None:
        self._data, self._event = [], ""

    def _dispatch(self) -> SSEEvent:
        event = SSEEvent("\n".join(self._data), self._event or "message", self._id)
        self._reset()
        return event


class ChunkInfo(msgspec.Struct, frozen=True, kw_only=True):
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cluster: str | None = None
    # A token chunk without text: a choice with no text, no role, no finish reason (aiperf
    # and other clients count such chunks as tokens of zero length).
    empty: bool = False


def _first_choice(chunk: dict[str, Any]) -> dict[str, Any]:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return {}


def _text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    value = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return value if isinstance(value, str) else ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(chunk: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None, None, None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached


def read_chunk(data: str) -> ChunkInfo:
    """One `data:` payload (not [DONE]); a server `error` object raises BenchError."""
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise BenchError(f"stream chunk is not JSON: {data[:80]!r}") from exc
    if not isinstance(chunk, dict):
        raise BenchError(f"stream chunk must be a JSON object, got {data[:80]!r}")
    if "error" in chunk:
        raise BenchError(f"server error in stream: {chunk['error']!r}")
    choice = _first_choice(chunk)
    prompt, completion, cached = _usage(chunk)
    prfaas = chunk.get("prfaas")
    cluster = None
    if isinstance(prfaas, dict):
        cluster = prfaas.get("cluster") if isinstance(prfaas.get("cluster"), str) else None
        cached = _int(prfaas.get("cached_tokens")) if "cached_tokens" in prfaas else cached
    finish = choice.get("finish_reason")
    text = _text(choice)
    delta = choice.get("delta")
    role = isinstance(delta, dict) and "role" in delta
    empty = bool(choice) and not text and not role and not isinstance(finish, str)
    return ChunkInfo(text=text, finish_reason=finish if isinstance(finish, str) else None,
                     prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                     cluster=cluster, empty=empty)
