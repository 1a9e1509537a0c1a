"""One request as the scheduler runs it: where it runs, its outbox, its handle, its result.

`RequestHandle` is what a submitter holds (services/router/app.py, the demo workload): iterate it
for text deltas, then read `result`; `cancel` stops the request. The scheduler's task writes
into its `Outbox`, which never blocks the writer: text accumulates until the client takes it,
so a slow client cannot stall the mesh connection other requests share.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import anyio
import msgspec

from services.contract.messages import PrefillDone, PrefixPull
from services.contract.types import Cluster
from services.router.errors import RouterError
from services.router.openai.schema import GenerationRequest
from services.router.policy import Decision


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request runs, decided before it starts."""

    request_id: str
    cluster: Cluster
    prefill_worker: str
    decode_worker: str
    prompt_tokens: int
    cached_tokens: int  # the prefix the prefill worker resumes from (the policy's view)
    decode_has_tokens: int  # the prefix whose KV the decode worker already holds
    decision: Decision
    pull: PrefixPull | None = None  # the cached prefix the prefill worker fetches first


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefill did not compute


@dataclass
class Outbox:
    """What a request has produced and its client has not taken yet (never blocks the writer)."""

    text: list[str] = field(default_factory=list)
    finished: Finished | None = None
    error: RouterError | None = None
    closed: bool = False
    ready: anyio.Event = field(default_factory=anyio.Event)
    # Set once, at close: a whole (non-streamed) response waits for this alone, not for
    # every token's `ready`.
    done: anyio.Event = field(default_factory=anyio.Event)

    def put(self, text: str) -> None:
        if text:
            self.text.append(text)
            self.ready.set()

    def close(self, finished: Finished | None, error: RouterError | None = None) -> None:
        self.finished, self.error, self.closed = finished, error, True
        self.ready.set()
        self.done.set()


class RequestHandle:
    """A running request: iterate for text deltas, then read `result`; `cancel` stops it."""

    def __init__(self, placement: Placement, request: GenerationRequest) -> None:
        self.placement = placement
        self.request = request
        self.scope = anyio.CancelScope()
        self.prefill: PrefillDone | None = None
        self.error: RouterError | None = None
        self.result: Finished | None = None
        self.started = self.first_token_at = 0.0
        self.outbox = Outbox()

    def cancel(self) -> None:
        self.scope.cancel()

    def release(self) -> None:
        """The client is done with the request: cancels it unless it has ended (cancelling a
        cancel scope formats the calling task's repr, a cost every request paid at its end)."""
        if not self.outbox.closed:
            self.cancel()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> str:
        """All text produced since the last call; raises the request's RouterError if failed."""
        box = self.outbox
        while not box.text and not box.closed:
            await box.ready.wait()
            box.ready = anyio.Event()
        if box.text:
            text, box.text = "".join(box.text), []
            return text
        if box.error is not None:
            raise box.error
        self.result = box.finished
        raise StopAsyncIteration

    async def collect(self) -> tuple[str, Finished]:
        """The whole text and the result (non-streaming responses); raises the request's
        RouterError if it failed. Wakes once, when the request ends."""
        box = self.outbox
        await box.done.wait()
        text, box.text = "".join(box.text), []
        if box.error is not None:
            raise box.error
        self.result = box.finished
        assert self.result is not None
        return text, self.result


class RequestIds:
    """Request ids unique across router restarts: a random prefix and a counter."""

    def __init__(self, prefix: str = "") -> None:
        # A given prefix makes ids reproducible (the simulation, run twice with one seed).
        self._prefix = prefix or secrets.token_hex(3)
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"req-{self._prefix}-{self._n}"
