"""One request as the scheduler runs it: what it asks, where it runs, its outbox, its handle,
its result.

`GenerationRequest` is the router's own request: the OpenAI schema (services/router/openai/
schema.py) validates a body into it, and the scheduler, the demo workload and the simulation
take it, knowing nothing of HTTP.

`RequestHandle` is what a submitter holds (services/router/app.py, the demo workload): iterate it
for text deltas (or `next_delta` for the tokens and logprobs beside the text), then read
`result`; `cancel` stops the request. The scheduler's task writes `Delta`s into its
`PendingDeltas` (`handle.outbox`), which never blocks the writer: they accumulate until the
client takes them, so a slow client cannot stall the mesh connection other requests share.
Tokens that add no text yet (part of a multi-byte character) stay in the outbox and reach the
client with the next text, so no streamed chunk is without text; what is left at the end is
the handle's `tail`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import msgspec

from services.contract.events import MigrationReason, attempt_id
from services.contract.messages import PrefillDone, PrefixPull
from services.contract.sampling import Sampling
from services.contract.types import Cluster
from services.router.errors import RouterError
from services.router.openai.text import TokenRecord
from services.router.policy import Decision

if TYPE_CHECKING:
    from services.router.metrics import RequestSeries



class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One validated request, as the scheduler takes it."""

    prompt: list[int]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every streamed chunk
    model: str = "prfaas"
    echo_text: str = ""  # completions with echo=true: the prompt text, sent first
    n: int = 1  # choices: `choices()` gives each its own request

    def choices(self) -> list[GenerationRequest]:
        """One request per choice, n = 1 each; choice i > 0 draws with a seed derived from
        the request's (choice 0 keeps it), so a seeded request is reproducible as a whole."""
        return [msgspec.structs.replace(self, n=1, sampling=msgspec.structs.replace(
            self.sampling, seed=choice_seed(self.sampling.seed, i))) for i in range(self.n)]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: the request's for choice 0, a distinct one derived from
    it for the others (None stays None: every choice draws a fresh seed)."""
    if seed is None or index == 0:
        return seed
    # An odd multiplier (2^64 / golden ratio) spreads the choices over the int64 range.
    mixed = (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


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
    # 0 for the request as placed; n after its n-th migration (services/router/runner.py).
    attempt: int = 0

    @property
    def wire_id(self) -> str:
        """The id the workers know this attempt by (the router's own for attempt 0)."""
        return attempt_id(self.request_id, self.attempt)


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request whose data path broke is to continue (services/router/runner.py):
    the runner's ask, the scheduler's placement answers it."""

    reason: MigrationReason
    attempt: int  # this continuation's number, from 1
    prompt: list[int]  # the request's prompt and every output token streamed so far
    failed_worker: str
    avoid: frozenset[str]  # the workers that failed this request so far
    cluster: Cluster | None  # the kind of cluster to prefill in; None: the policy decides


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefill did not compute


class Delta(msgspec.Struct, frozen=True):
    """What a request produced since the client last took: text, tokens, their logprobs
    (None when the request did not ask for them)."""

    text: str = ""
    tokens: int = 0
    logprobs: tuple[TokenRecord, ...] | None = None

    def __add__(self, other: Delta) -> Delta:
        logprobs = None if self.logprobs is None and other.logprobs is None else (
            *(self.logprobs or ()), *(other.logprobs or ()))
        return Delta(self.text + other.text, self.tokens + other.tokens, logprobs)


def merged(deltas: list[Delta]) -> Delta:
    total = Delta()
    for delta in deltas:
        total = total + delta
    return total


@dataclass
class PendingDeltas:
    """What a request has produced and its client has not taken yet (never blocks the writer)."""

    deltas: list[Delta] = field(default_factory=list)
    finished: Finished | None = None
    error: RouterError | None = None
    closed: bool = False
    ready: anyio.Event = field(default_factory=anyio.Event)
    # Set once, at close: a whole (non-streamed) response waits for this alone, not for
    # every token's `ready`.
    done: anyio.Event = field(default_factory=anyio.Event)

    def put(self, delta: Delta | str) -> None:
        if isinstance(delta, str):
            delta = Delta(delta)
        if delta.text or delta.tokens:
            self.deltas.append(delta)
            self.ready.set()

    @property
    def has_text(self) -> bool:
        return any(delta.text for delta in self.deltas)

    def take(self) -> Delta | None:
        """Everything pending, if it adds text; else None (tokens wait for their text)."""
        if not self.has_text:
            return None
        total, self.deltas = merged(self.deltas), []
        return total

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
        self.started = self.first_token_at = self.last_token_at = 0.0
        # The running attempt (services/router/runner.py): its scope, and whether it still
        # waits for its KV (no token yet), so that a stalled link can move it on.
        self.attempt_scope: anyio.CancelScope | None = None
        self.awaiting_kv = False
        # Its histograms (services/router/metrics.py), set by the scheduler that places it.
        self.series: RequestSeries | None = None
        self.outbox = PendingDeltas()

    def cancel(self) -> None:
        self.scope.cancel()

    def interrupt(self) -> None:
        """Gives up the running attempt (its link stalled): the runner continues the request
        elsewhere (the request itself is not cancelled)."""
        if self.attempt_scope is not None:
            self.attempt_scope.cancel()

    def release(self) -> None:
        """The client is done with the request: cancels it unless it has ended (cancelling a
        cancel scope formats the calling task's repr, a cost every request paid at its end)."""
        if not self.outbox.closed:
            self.cancel()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> str:
        """All text produced since the last call; raises the request's RouterError if failed."""
        return (await self.next_delta()).text

    def take(self) -> Delta | None:
        """Without waiting: what is pending if it adds text (`next_delta` waits for it)."""
        return self.outbox.take()

    @property
    def done(self) -> bool:
        """Closed, with no text left to take (`tail` holds what tokens remain)."""
        return self.outbox.closed and not self.outbox.has_text

    async def wait(self) -> None:
        """Until the outbox changes (a delta, or the end)."""
        await self.outbox.ready.wait()
        self.outbox.ready = anyio.Event()

    async def next_delta(self) -> Delta:
        """What was produced since the last call, with text; at the end, StopAsyncIteration
        (`result` set) or the request's RouterError."""
        while True:
            delta = self.take()
            if delta is not None:
                return delta
            if self.outbox.closed:
                if self.outbox.error is not None:
                    raise self.outbox.error
                self.result = self.outbox.finished
                raise StopAsyncIteration
            await self.wait()

    def finish(self) -> Delta:
        """Once closed: sets `result` (raises the request's error) and returns the tokens
        left without text (the tail: an end-of-text or stop token, say)."""
        box = self.outbox
        if box.error is not None:
            raise box.error
        self.result = box.finished
        tail, box.deltas = merged(box.deltas), []
        return tail

    async def collect_delta(self) -> tuple[Delta, Finished]:
        """Everything produced, text, tokens and logprobs, and the result (raises the
        request's RouterError if it failed). Wakes once, when the request ends."""
        await self.outbox.done.wait()
        whole = self.finish()
        assert self.result is not None
        return whole, self.result

    async def collect(self) -> tuple[str, Finished]:
        """The whole text and the result (non-streaming responses)."""
        delta, result = await self.collect_delta()
        return delta.text, result


class RequestIds:
    """Request ids unique across router restarts: a random prefix and a counter."""

    def __init__(self, prefix: str = "") -> None:
        # A given prefix makes ids reproducible (the simulation, run twice with one seed).
        self._prefix = prefix or secrets.token_hex(3)
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"req-{self._prefix}-{self._n}"
