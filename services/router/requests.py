"""The router's request, from the moment the OpenAI face has validated it to its end: what it
asks (`GenerationRequest`) and its one record as it runs (`RequestHandle`, with its outbox of
deltas and its end, `RequestEnd`).

`GenerationRequest` is the router's own request: the OpenAI schema
(services/router/openai_schema.py) validates a body into it, and the scheduler, the demo
workload and the simulation take it, knowing nothing of HTTP or of the OpenAI schema.

`RequestHandle` is what a submitter holds (the OpenAI face, the demo workload): iterate it for
text deltas (or `next_delta` for the tokens and logprobs beside the text), then read `result`;
`cancel` stops the request. The runner (services/router/runner.py) writes `Delta`s into its
`PendingDeltas` (`handle.outbox`), which never blocks the writer: they accumulate until the
client takes them, so a slow client cannot stall the mesh connection other requests share.
Tokens that add no text yet (part of a multi-byte character) stay in the outbox and reach the
client with the next text, so no streamed chunk is without text; what is left at the end is the
handle's `tail`. The handle is the request's one record: the runner writes it, and `ended`
records its end once (`RequestEnd`: TTFT, TPOT and end-to-end computed there), which the
scheduler feeds to its counts, the histograms, the `RequestDone` event and the policy.
`interrupt` and `silence` say how a running attempt broke when the scheduler, not the data
path, saw it (a stalled link, a silent worker).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import msgspec

from mesh import native
from mesh.errors import PeerGone
from services.contract.errors import KVStalled
from services.contract.messages import PrefillDone
from services.contract.sampling import Sampling
from services.router.errors import DataPathBroken, RouterError, UpstreamFailed
from services.router.placement import Placement
from services.router.request_metrics import RequestSeries
from services.router.text import TokenRecord

if TYPE_CHECKING:
    from opentelemetry.trace import Span


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

    def pop_text(self) -> Delta | None:
        """Everything pending, if it adds text; else None (tokens wait for their text)."""
        if not self.has_text:
            return None
        total, self.deltas = merged(self.deltas), []
        return total

    def close(self, finished: Finished | None, error: RouterError | None = None) -> None:
        self.finished, self.error, self.closed = finished, error, True
        self.ready.set()
        self.done.set()


@dataclass(frozen=True)
class RequestEnd:
    """How one request ended, recorded once (`RequestHandle.ended`): the one source of its
    counts, its histograms, its `RequestDone` event, the policy's observation and its span."""

    at: float
    result: Finished | None
    error: RouterError | None  # what its client meets: its own error, or "cancelled"
    cancelled: bool
    ttft_s: float | None  # sent to the first token; None when no token came
    e2e_s: float  # sent to the end
    tpot_s: float | None  # (e2e - TTFT) / (completion tokens - 1); None below two tokens

    @property
    def why(self) -> str:
        """The end in words: "" when it completed."""
        if self.cancelled:
            return "cancelled"
        return self.error.message if self.error is not None else ""


class RequestHandle:
    """A running request: iterate for text deltas, then read `result`; `cancel` stops it.
    The router's one record of the request: `RequestRunner` writes it as the request runs,
    and `ended` records its end once."""

    def __init__(self, placement: Placement, request: GenerationRequest, *,
                 started: float = 0.0, trace: Span | None = None,
                 series: RequestSeries | None = None) -> None:
        self.placement = placement
        self.request = request
        # The loop's own scopes (mesh.native): anyio's wrapper finds the backend each time.
        self.scope = native.deadline_scope()
        self.prefill: PrefillDone | None = None
        self.error: RouterError | None = None
        self.result: Finished | None = None
        self.started = started
        self.first_token_at = self.last_token_at = 0.0
        # When the second output token came (the time to second token); 0.0 until then.
        self.second_token_at = 0.0
        # The running attempt (`RequestRunner`): its scope, and whether it still
        # waits for its KV (no token yet), so that a stalled link can move it on; whether
        # its prefill call is pending and when it started (its progress: that, or the last
        # token), so that a silent worker can be told from a queue (`silence`); and what
        # broke it, once interrupted.
        self.attempt_scope: native.DeadlineScope | None = None
        self.awaiting_kv = False
        self.prefill_pending = False
        self.progress_at = 0.0
        self.interrupted: DataPathBroken | None = None
        # Its histograms (`RequestMetrics`), chosen by the scheduler that places it.
        self.series = series
        self.outbox = PendingDeltas()
        # With tracing on (services/contract/tracing.py): its span, and its running migration's.
        self.trace = trace
        self.migration_trace: Span | None = None
        self.end: RequestEnd | None = None

    def ended(self, now: float) -> RequestEnd:
        """Records the request's end at `now` (its timings computed here, once) and closes
        its outbox: the client gets the result, or the error (cancelled when neither)."""
        result, cancelled = self.result, self.result is None and self.error is None
        error = UpstreamFailed(f"request {self.placement.request_id} was cancelled") \
            if cancelled else self.error
        ttft = self.first_token_at - self.started if self.first_token_at else None
        e2e = now - self.started
        tpot = (e2e - ttft) / (result.completion_tokens - 1) if (
            ttft is not None and result is not None and result.completion_tokens > 1) else None
        self.end = RequestEnd(at=now, result=result, error=error, cancelled=cancelled,
                              ttft_s=ttft, e2e_s=e2e, tpot_s=tpot)
        self.outbox.close(result, error)
        return self.end

    def observe_end(self, end: RequestEnd) -> None:
        """Observes the request's `end` in its histograms (`series`): its first token and
        prefill whatever the outcome, its duration and lengths when it completed."""
        series, result, prefill = self.series, end.result, self.prefill
        if series is None:
            return
        if end.ttft_s is not None:
            series.ttft.observe(end.ttft_s)
        if prefill is not None:
            series.queue.observe(prefill.queue_s)
            series.cache.queried += prefill.prompt_tokens
            series.cache.hit += prefill.reused_tokens
        if result is None:
            return
        series.duration.observe(end.e2e_s)
        series.prompt.observe(result.prompt_tokens)
        series.completion.observe(result.completion_tokens)
        if end.tpot_s is not None:
            series.tpot.observe(end.tpot_s)
            series.tpot_alias.observe(end.tpot_s)

    def cancel(self) -> None:
        self.scope.cancel()

    def interrupt(self, broken: DataPathBroken | None = None) -> None:
        """Gives up the running attempt, broken as `broken` says (by default: its link
        stalled): the runner continues the request elsewhere (the request itself is not
        cancelled)."""
        if self.attempt_scope is not None:
            self.interrupted = broken or broken_by_stall(self.placement)
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

    def poll_delta(self) -> Delta | None:
        """Without waiting: what is pending if it adds text (`next_delta` waits for it)."""
        return self.outbox.pop_text()

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
            delta = self.poll_delta()
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


def broken_by_stall(p: Placement) -> DataPathBroken:
    stalled = KVStalled(f"the link from {p.prefill_worker} to {p.decode_worker} stalled "
                        f"with the KV of {p.wire_id} on it")
    return DataPathBroken(str(stalled), prefill=None, decode=stalled)


def silence(handle: RequestHandle, silent: Collection[str], now: float,
            bound: float) -> DataPathBroken | None:
    """How a running attempt broke if its decode worker (or its prefill worker, while the
    prefill call is pending) is among the `silent` ones (answering no status poll) and the
    attempt made no progress for `bound` seconds; None when it did not."""
    p, quiet = handle.placement, now - max(handle.progress_at, handle.last_token_at)
    if handle.attempt_scope is None or quiet < bound:
        return None
    if p.decode_worker in silent:
        side, worker = "decode", p.decode_worker
    elif handle.prefill_pending and p.prefill_worker in silent:
        side, worker = "prefill", p.prefill_worker
    else:
        return None
    gone = PeerGone(f"{worker} answers no status poll and request {p.wire_id} made no "
                    f"progress on it for {quiet:.1f} s (silence_s={bound:g}): declared lost")
    return DataPathBroken(f"{side} on {worker} failed: {gone}",
                          prefill=gone if side == "prefill" else None,
                          decode=gone if side == "decode" else None)


class RequestIds:
    """Request ids unique across router restarts: a random prefix and a counter."""

    def __init__(self, prefix: str = "") -> None:
        # A given prefix makes ids reproducible (the simulation, run twice with one seed).
        self._prefix = prefix or secrets.token_hex(3)
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"req-{self._prefix}-{self._n}"
