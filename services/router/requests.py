"""The router's request, from the moment the OpenAI face has validated it to its last token:
what it asks, where it runs, the text its tokens become, its outbox and handle, the one driver
that runs it over the mesh (with migration), and the latency histograms it records.

`GenerationRequest` is the router's own request: the OpenAI face (services/router/openai.py)
validates a body into it, and the scheduler, the demo workload and the simulation take it,
knowing nothing of HTTP or of the OpenAI schema.

Text: `TextAssembler` turns streamed token ids into text deltas, holding back an incomplete
UTF-8 character and any tail that may still become a stop string (re-decoding only the tokens
since the last clean character boundary, as vLLM's incremental detokenizer does);
`assemble_reference` is the slow reference it is tested equal to. The workers send token ids
and numbers only (services/contract/messages.py); the router, which holds the tokenizer, names
each token's logprobs here (`chat_entry`: a token that is part of a multi-byte character shows
U+FFFD in `token`, and `bytes` has its exact bytes).

`RequestHandle` is what a submitter holds (the OpenAI face, the demo workload): iterate it for
text deltas (or `next_delta` for the tokens and logprobs beside the text), then read `result`;
`cancel` stops the request. The runner writes `Delta`s into its `PendingDeltas`
(`handle.outbox`), which never blocks the writer: they accumulate until the client takes them,
so a slow client cannot stall the mesh connection other requests share. Tokens that add no
text yet (part of a multi-byte character) stay in the outbox and reach the client with the
next text, so no streamed chunk is without text; what is left at the end is the handle's
`tail`.

`drive` is the data path, the one request driver: the prefill call (`PrefillRequest` to the
prefill worker, which streams the KV the decode worker lacks straight to it) beside the decode
worker's token stream (`DecodeRequest`). `RequestRunner` runs a router's request on it: the
tokens go through a `TextAssembler` into the request's outbox, with their logprobs when asked;
a stop token (stop_token_ids) counts but, as in vLLM, adds no text. The first error either
side meets is the request's (`UpstreamFailed`) and cancels the other; cancelling the request's
scope (the client left) aborts the decode stream at its worker and gives up the prefill call.
`prfaas send` (services/cli/send.py) drives a prompt through two workers it names on the same
`drive`. The handle is the request's one record: the runner writes it, and `ended` records
its end once (`RequestEnd`: TTFT, TPOT and end-to-end computed there), which the scheduler
feeds to its counts, the histograms, the `RequestDone` event and the policy.

Migration (`RequestRunner.run`): when an attempt's data path breaks, the request continues
elsewhere, at most `migration_limit` times, as NVIDIA Dynamo's request migration does:
1. `breakage` reads what each side met and says what broke: the decode worker or its stream
   (decode_lost), the prefill worker before the first token (prefill_lost), the KV making no
   progress across the link for `kv_stall_s` (kv_stalled: the decode worker saw no piece
   for that long, or the prefill worker's lanes were not accepted that long after its
   compute; a job queued at the prefill worker is not stalled) or
   the KV stream cut on its way (kv_cut); an error of the request itself (a bad value, its
   deadline) is not a breakage and fails it as before. A worker that hangs (alive but
   silent: stopped, or cut off) breaks nothing the runner can see: the scheduler, which
   polls every worker's status, interrupts an attempt that made no progress for
   `silence_s` on a worker that answers no status poll (`silence`), and the runner reads it
   as that worker lost (decode_lost, or prefill_lost while the prefill call is pending);
2. the prompt and every output token already streamed to the client become the new
   attempt's prompt; max_tokens and min_tokens shrink by those tokens, and a seeded sampled
   request keeps its place in its seed's stream (`continued`: token i of the new attempt is
   drawn as token k + i of the old). The model is deterministic at temperature 0, so a
   greedy request gives the text it would have given unbroken;
3. the runner places it again (`Migration`, services/router/placement.py): decode_lost by
   the current policy, away from the lost worker; prefill_lost in the same kind of cluster on
   another worker, else the other kind; kv_stalled and a cut cross-cluster stream in the PD
   cluster. A worker whose connection broke is marked down until it answers a status poll
   again;
4. the client's stream goes on from the same TextAssembler: no token repeated or missing,
   usage counts the whole answer. Each migration is a `RequestMigrated` event (the request's
   timeline) and counted by reason (`statistics`, /metrics). Past the limit, or with no
   worker to continue on, the request ends with an explicit error.
The workers know each attempt by its own id (`attempt_id`: a decode worker refuses an id it
has decoded), and the old attempt's KV is let go on both ends: the decode stream's end frees
its pieces and refuses late lanes, and the prefill call is given up (its job cancelled).

Metrics (`RequestMetrics`), observed as requests run (the scheduler at a request's end, the
runner at each streamed token): per request, labelled by the cluster that prefilled and the
policy that placed it, the time to first token, every gap between streamed tokens, the
end-to-end time, the time queued at the prefill worker, the time per output token, prompt and
completion lengths; and by cluster, the prompt tokens looked up in the prefill worker's prefix
cache and those found there. The names, units and buckets are vLLM's and NVIDIA Dynamo's
habits (docs/observability.md); the buckets are services/service.py's.

Traces (services/contract/tracing.py, with tracing on): the scheduler gives a request its
span; the runner adds a span per attempt, whose traceparent the prefill and decode requests
carry to the workers, a span per migration, and the first token as an event.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import anyio
import msgspec
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh import native
from mesh.errors import MeshError, PeerGone, RemoteError, StreamAborted
from mesh.events import EventBus
from mesh.histogram import Histogram, HistogramSeries
from mesh.node import Node
from services.contract.errors import KVStalled
from services.contract.events import (
    Event,
    MigrationReason,
    RequestMigrated,
    RequestPhase,
)
from services.contract.messages import (
    DecodeRequest,
    PrefillDone,
    PrefillRequest,
    TokenChunk,
)
from services.contract.sampling import Sampling, TokenLogprob
from services.contract.tracing import Tracer, failed, traceparent
from services.contract.types import Cluster, Phase
from services.model.sampling import continued_seed
from services.model.tokenizer import TokenizerLike
from services.router.config import SchedulerConfig
from services.router.errors import (
    DataPathBroken,
    NoWorkerAvailable,
    QueueFull,
    RouterError,
    UpstreamFailed,
)
from services.router.placement import Migration, Placement, Placer
from services.router.workers import WorkerTable
from services.service import SECONDS_BUCKETS, TOKENS_BUCKETS

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
REQUEST_LABELS = ("cluster", "policy")

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


class TextAssembler:
    """Token ids in, text deltas out: UTF-8 completed, cut at the first stop string.

    Decoding follows vLLM's incremental detokenizer idea: re-decode only the tokens since the
    last clean character boundary and emit the new suffix.
    """

    def __init__(self, tokenizer: TokenizerLike, stop: Sequence[str] = (),
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        # vLLM's min_tokens: stop strings are looked for once this many tokens are out.
        self._min_tokens = min_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already taken
        self._read = 0
        self._held = ""  # text that may still begin a stop string
        self.stopped = False
        self.tokens = 0
        self.chars = 0  # of the text returned so far

    def push(self, ids: Sequence[int]) -> str:
        """The text these ids add that is safe to send; "" once a stop string was found."""
        if self.stopped:
            return ""
        self.tokens += len(ids)
        self._ids.extend(ids)
        return self._count(self._cut(self._decode_new(final=False)))

    def skip(self, count: int) -> None:
        """Tokens that count but add no text (a stop token, which is not shown)."""
        self.tokens += count

    def finish(self) -> str:
        """Whatever is still held back (called when generation ends)."""
        if self.stopped:
            return ""
        text = self._cut(self._decode_new(final=True))
        if not self.stopped:
            text, self._held = text + self._held, ""
        return self._count(text)

    def _count(self, text: str) -> str:
        self.chars += len(text)
        return text

    def _decode_new(self, final: bool) -> str:
        seen = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full = self._tokenizer.decode(self._ids[self._prefix:])
        if full.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen):]

    def _cut(self, new: str) -> str:
        text = self._held + new
        if self.tokens < self._min_tokens:
            self._held = ""
            return text
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = _stop_prefix_len(text, self._stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


def assemble_reference(tokenizer: TokenizerLike, ids: Sequence[int],
                       stop: Sequence[str] = ()) -> tuple[str, bool]:
    """Slow reference of TextAssembler: decode all ids, cut at the earliest stop string."""
    text = tokenizer.decode(list(ids))
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


@runtime_checkable
class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    """One output token in the chat format (choices[i].logprobs.content[j])."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class TokenRecord(msgspec.Struct, frozen=True):
    """One output token's logprobs, and where its text begins in the generated text."""

    entry: ChatTokenLogprob
    offset: int


def _named(tokenizer: TokenizerLike, token_id: int) -> tuple[str, list[int]]:
    raw = (tokenizer.token_bytes(token_id) if isinstance(tokenizer, TokenBytes)
           else tokenizer.decode([token_id]).encode("utf-8"))
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_entry(tokenizer: TokenizerLike, token_id: int,
               logprob: TokenLogprob) -> ChatTokenLogprob:
    token, raw = _named(tokenizer, token_id)
    top = [TopLogprob(*_with_value(_named(tokenizer, alt), value))
           for alt, value in zip(logprob.top_ids, logprob.top_logprobs, strict=True)]
    return ChatTokenLogprob(token, logprob.logprob, raw, top)


def _with_value(named: tuple[str, list[int]], value: float) -> tuple[str, float, list[int]]:
    return named[0], value, named[1]


def text_offsets(tokenizer: TokenizerLike, ids: Sequence[int], base: int, end: int) -> list[int]:
    """Where each of `ids` begins in the text, their text spanning [base, end): the decoded
    length before it, an incomplete character's U+FFFD not counted."""
    return [min(base + len(tokenizer.decode(list(ids[:j])).rstrip("\ufffd")), end)
            for j in range(len(ids))]


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

    def cancel(self) -> None:
        self.scope.cancel()

    def interrupt(self, broken: DataPathBroken | None = None) -> None:
        """Gives up the running attempt, broken as `broken` says (by default: its link
        stalled): the runner continues the request elsewhere (the request itself is not
        cancelled)."""
        if self.attempt_scope is not None:
            self.interrupted = broken or _stalled(self.placement)
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


def _stalled(p: Placement) -> DataPathBroken:
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


class Driven(msgspec.Struct, frozen=True, kw_only=True):
    """How one request's data path ended: the prefill worker's report, the finish reason."""

    prefill: PrefillDone
    finish_reason: str


def _nothing() -> None:
    pass


async def drive(node: Node, prefill_worker: str, prefill: PrefillRequest, decode_worker: str,
                decode: DecodeRequest, *, timeout: float,
                on_chunk: Callable[[TokenChunk], str | None],
                on_prefilled: Callable[[], None] = _nothing, grace_s: float = 0.0) -> Driven:
    """The data path of one placed request: the prefill call beside the decode worker's token
    stream. The one request driver: the router's `RequestRunner` and `prfaas send` use it.

    Each chunk goes to `on_chunk`, which returns the finish reason once the request is done;
    done before the worker (a stop string, max_tokens), leaving the stream aborts the rest of
    the generation there. `on_prefilled` runs when the prefill call ends, either way. Raises
    DataPathBroken (an UpstreamFailed) naming the worker: the first error either side met,
    which cancels the other; after a failed prefill the token stream has `grace_s` to report
    its own, more specific error first (a cut KV stream), which then names it. The error
    holds what each side met.
    """
    failures: list[tuple[str, UpstreamFailed]] = []
    done: list[PrefillDone] = []
    reason: str | None = None
    reading = native.deadline_scope(math.inf)

    async def call_prefill() -> None:
        try:
            done.append(await node.call(prefill_worker, prefill, PrefillDone, timeout=timeout))
        except MeshError as exc:
            failures.append(("prefill", _failed(f"prefill on {prefill_worker} failed", exc)))
            reading.deadline = min(reading.deadline, native.clock()() + grace_s)
        finally:
            on_prefilled()

    async with anyio.create_task_group() as group:
        native.start_soon(group, call_prefill)
        with reading:
            reason = await _read_tokens(node, decode_worker, decode, timeout, on_chunk,
                                        failures)
        if failures:
            group.cancel_scope.cancel()
    if failures:
        raise _broken(failures, grace_s)
    if reason is None:
        raise UpstreamFailed(f"decode on {decode_worker} ended request {decode.request_id} "
                             "without a finish reason")
    return Driven(prefill=done[0], finish_reason=reason)


async def _read_tokens(node: Node, worker: str, decode: DecodeRequest, timeout: float,
                       on_chunk: Callable[[TokenChunk], str | None],
                       failures: list[tuple[str, UpstreamFailed]]) -> str | None:
    """Feeds the decode worker's token stream to `on_chunk`; the finish reason it gave.
    The chunks are taken as they are delivered (`StreamReader.take_each`): this task wakes
    at the end, not for every chunk."""
    finished: list[tuple[str, str | None]] = []

    def take(chunk: msgspec.Struct) -> bool:
        assert isinstance(chunk, TokenChunk)
        reason = on_chunk(chunk)
        if reason is not None:
            finished.append((reason, chunk.finish_reason))
        return reason is None

    try:
        async with node.open_stream(worker, decode, timeout=timeout) as chunks:
            if not await chunks.take_each(take):
                return None
            reason, worker_finished = finished[0]
            if worker_finished is not None:
                # The worker has finished: its End follows at once; reading it spares it
                # an Abort (bench-router: 3% of the router's CPU).
                extra = await _after_end(chunks)
                if extra is not None:
                    failures.append(("decode", UpstreamFailed(
                        f"decode on {worker} sent {extra} after the finish reason")))
            return reason
    except MeshError as exc:
        failures.append(("decode", _failed(f"decode on {worker} failed", exc)))
    return None


def _broken(failures: list[tuple[str, UpstreamFailed]], grace_s: float) -> DataPathBroken:
    decoded = [f for kind, f in failures if kind == "decode"]
    first = decoded[0] if decoded and grace_s > 0 else failures[0][1]
    # A side's own error is the mesh error behind its UpstreamFailed, if any.
    met = {kind: f.__cause__ if isinstance(f.__cause__, Exception) else f
           for kind, f in reversed(failures)}
    broken = DataPathBroken(first.message, prefill=met.get("prefill"), decode=met.get("decode"))
    broken.__cause__ = first.__cause__
    return broken


def _failed(what: str, exc: MeshError) -> UpstreamFailed:
    """UpstreamFailed for `exc`, which stays its cause (a RemoteError's kind and detail)."""
    failure = UpstreamFailed(f"{what}: {exc}")
    failure.__cause__ = exc
    return failure


# After a failed prefill, the decode side's own error is awaited this long: when the decode
# worker died, the prefill fails too (its KV lanes broke), and the decode side says which.
GRACE_S = 0.5
# Errors a worker raises that say its side of the data path broke, not that the request is
# wrong (services/contract/errors.py): a request meeting one of them may continue elsewhere.
BREAKAGES = frozenset({"KVTransferError", "KVStalled", "DataPathError", "WrongRole"})

class RunnerStatistics(msgspec.Struct, frozen=True):
    migrations: dict[str, int]  # by reason (MigrationReason)
    gave_up: int  # requests past migration_limit
    resumed: int  # migrated attempts that streamed their first token
    resume_s: float  # their summed time from the break to that token


class RequestRunner:
    """Runs placed requests (module docstring); `phase` publishes a request's progress. It
    keeps `workers` told of its requests (a prefill ended, an attempt moved) and places a
    migrated request's next attempt with `placer` (None: none migrates)."""

    def __init__(self, node: Node, workers: WorkerTable, tokenizer: TokenizerLike,
                 config: SchedulerConfig, events: EventBus[Event],
                 clock: Callable[[], float], placer: Placer | None = None, *,
                 tracer: Tracer | None = None) -> None:
        self.node, self.workers, self.tokenizer = node, workers, tokenizer
        self.config, self.events, self.clock = config, events, clock
        self.placer = placer
        self.tracer = tracer
        self._migrations: dict[str, int] = {}
        self._gave_up = self._resumed = 0
        self._resume_s = 0.0

    async def serve(self, handle: RequestHandle) -> None:
        """Runs one request to its end (`run`), its result or its error on its handle: its
        failure is the request's, never the router's."""
        try:
            with handle.scope:
                handle.result = await self.run(handle)
        except RouterError as exc:
            handle.error = exc
        except MeshError as exc:
            handle.error = UpstreamFailed(f"request {handle.placement.request_id}: {exc}")
        except Exception as exc:
            log.exception("request %s failed in the router", handle.placement.request_id)
            handle.error = RouterError(f"internal error: {type(exc).__name__}: {exc}")

    async def run(self, handle: RequestHandle) -> Finished:
        """`drive` with the tokens going through a TextAssembler into the request's outbox,
        continued elsewhere when its data path breaks (module docstring); the result, or
        the error that ended it."""
        request = handle.request
        assembler = TextAssembler(self.tokenizer, request.stop, request.sampling.min_tokens)
        kept: list[int] = []  # output tokens taken so far, over every attempt
        avoid: set[str] = set()
        broken_at: list[float] = []  # when the last break was met, until the next token
        while True:
            try:
                driven = await self._attempt(handle, assembler, kept, broken_at)
                break
            except DataPathBroken as broken:
                broken_at[:] = [self.clock()]
                if handle.trace is None:
                    await self._migrate(handle, broken, kept, avoid)
                else:
                    await self._traced_migrate(handle, broken, kept, avoid)
        handle.prefill = driven.prefill
        handle.outbox.put(assembler.finish())
        prompt = len(request.prompt)
        return Finished(finish_reason=driven.finish_reason, prompt_tokens=prompt,
                        completion_tokens=assembler.tokens,
                        cached_tokens=min(prompt, driven.prefill.reused_tokens))

    async def _attempt(self, handle: RequestHandle, assembler: TextAssembler,
                       kept: list[int], broken_at: list[float]) -> Driven:
        """One attempt: the prompt and the tokens kept so far, on the placement's workers."""
        p, request, cfg = handle.placement, handle.request, self.config
        prompt = [*request.prompt, *kept]
        sampling = continued(request.sampling, len(kept))
        self.phase(p.request_id, "prefill", p.prefill_worker, f"cluster {p.cluster}")
        # A whole (non-streamed) answer without stop strings needs no token before the last
        # but the first (its time is the TTFT): the worker sends the rest at the finish.
        # Only KV that crosses a link has a stall bound: within a cluster a wait is a queue.
        span = None if handle.trace is None else self._attempt_span(handle)
        trace = "" if span is None else traceparent(span)
        decode = DecodeRequest(request_id=p.wire_id, prompt=prompt, sampling=sampling,
                               kv_timeout=cfg.kv_timeout_s,
                               incremental=request.stream or bool(request.stop),
                               kv_stall=cfg.kv_stall_s if p.cluster == "prfaas" else 0.0,
                               hashes=p.hashes, trace=trace)
        handle.awaiting_kv = handle.prefill_pending = True
        handle.progress_at, handle.interrupted = self.clock(), None
        scope = handle.attempt_scope = native.deadline_scope()
        with scope:
            try:
                return await drive(
                    self.node, p.prefill_worker,
                    self._prefill_request(handle, prompt, sampling, trace),
                    p.decode_worker, decode, timeout=cfg.request_timeout_s,
                    on_chunk=lambda chunk: self._take(handle, chunk, assembler, kept, broken_at),
                    on_prefilled=lambda: self._prefill_ended(handle, p.prefill_worker),
                    grace_s=GRACE_S)
            except BaseException as exc:
                if span is not None:
                    failed(span, exc)
                raise
            finally:
                handle.attempt_scope, handle.awaiting_kv = None, False
                if span is not None:
                    span.end()
        # Interrupted (Scheduler): the link its KV crosses stalled, or a worker went silent.
        raise handle.interrupted or _stalled(p)

    def _prefill_ended(self, handle: RequestHandle, worker: str) -> None:
        handle.prefill_pending = False
        self.workers.prefilled(worker)

    def _attempt_span(self, handle: RequestHandle) -> Span:
        """The span of the request's attempt on its placement (its workers' spans' parent)."""
        assert self.tracer is not None and handle.trace is not None
        p = handle.placement
        return self.tracer.start(f"attempt {p.attempt}", handle.trace, {
            "prfaas.attempt": p.attempt, "prfaas.attempt_id": p.wire_id,
            "prfaas.cluster": p.cluster, "prfaas.prefill_worker": p.prefill_worker,
            "prfaas.decode_worker": p.decode_worker, "prfaas.lanes": p.lanes,
            "prfaas.cached_tokens": p.cached_tokens,
            "prfaas.decode_has_tokens": p.decode_has_tokens}, kind="client")

    async def _traced_migrate(self, handle: RequestHandle, broken: DataPathBroken,
                              kept: list[int], avoid: set[str]) -> None:
        """`_migrate` inside a `migration` span: from the break to the next attempt placed
        (its lookup and decision are the span's children), or to the error that ends it."""
        assert self.tracer is not None
        found = breakage(broken, handle.placement)
        with self.tracer.span("migration", handle.trace, {
                "prfaas.migration.reason": found[0] if found else "none",
                "prfaas.migration.failed_worker": found[1] if found else "",
                "prfaas.migration.tokens_kept": len(kept),
                "prfaas.migration.detail": broken.message}) as span:
            handle.migration_trace = span
            try:
                await self._migrate(handle, broken, kept, avoid)
            finally:
                handle.migration_trace = None
            p = handle.placement
            span.set_attributes({"prfaas.migration.attempt": p.attempt,
                                 "prfaas.migration.prefill_worker": p.prefill_worker,
                                 "prfaas.migration.decode_worker": p.decode_worker,
                                 "prfaas.migration.cluster": p.cluster})

    async def _migrate(self, handle: RequestHandle, broken: DataPathBroken, kept: list[int],
                       avoid: set[str]) -> None:
        """Places the request's next attempt (steps 1-3 of the module docstring), or raises
        the error that ends it."""
        p, limit = handle.placement, self.config.migration_limit
        found = breakage(broken, p)
        if found is None or limit == 0 or self.placer is None:
            raise broken
        reason, worker, lost = found
        if p.attempt >= limit:
            self._gave_up += 1
            raise UpstreamFailed(f"{broken.message}; request {p.request_id} was not continued: "
                                 f"it has been migrated {p.attempt} times, migration_limit="
                                 f"{limit}") from broken
        avoid.add(worker)
        migration = Migration(
            reason=reason, attempt=p.attempt + 1, prompt=[*handle.request.prompt, *kept],
            failed_worker=worker, worker_lost=lost, avoid=frozenset(avoid),
            cluster=_cluster_after(reason, p))
        try:
            placed = await self._placed_again(handle, self.placer, migration)
        except (NoWorkerAvailable, QueueFull) as exc:
            raise UpstreamFailed(f"{broken.message}; request {p.request_id} could not be "
                                 f"continued: {exc.message}") from broken
        self._migrations[reason] = self._migrations.get(reason, 0) + 1
        self._published(migration, placed, len(kept), broken.message)

    async def _placed_again(self, handle: RequestHandle, placer: Placer,
                            migration: Migration) -> Placement:
        """Places a migrated request's next attempt and moves the request's share of the
        worker table there; NoWorkerAvailable when nothing can take it (the request's
        placement is then unchanged)."""
        old = handle.placement
        if migration.worker_lost:
            self.workers.lost(migration.failed_worker)
        if migration.reason == "kv_stalled":
            placer.hold_link(old)
        placed, _ = await placer.place(old.request_id, migration.prompt, migration,
                                       handle.migration_trace)
        self.workers.released(old.decode_worker)
        self.workers.dispatched(placed.prefill_worker, placed.decode_worker)
        handle.placement = placed
        self.phase(old.request_id, "queued", placed.prefill_worker,
                   f"migrated ({migration.reason}): {placed.decision.reason}")
        return placed

    def _published(self, migration: Migration, placed: Placement, kept: int,
                   detail: str) -> None:
        if not self.events.subscribed:  # the dashboard's and the simulation's
            return
        self.events.publish(RequestMigrated(
            ts=self.clock(), source="router", request_id=placed.request_id,
            attempt=migration.attempt, reason=migration.reason,
            failed_worker=migration.failed_worker, prefill_worker=placed.prefill_worker,
            decode_worker=placed.decode_worker, cluster=placed.cluster, tokens_kept=kept,
            detail=detail))

    def _prefill_request(self, handle: RequestHandle, prompt: list[int],
                         sampling: Sampling, trace: str = "") -> PrefillRequest:
        p = handle.placement
        return PrefillRequest(
            request_id=p.wire_id, prompt=prompt, decode_worker=p.decode_worker,
            decode_has_tokens=p.decode_has_tokens, sampling=sampling, connections=p.lanes,
            pull=p.pull, kv_stall=self.config.kv_stall_s if p.cluster == "prfaas" else 0.0,
            hashes=p.hashes, trace=trace)

    def _take(self, handle: RequestHandle, chunk: TokenChunk, assembler: TextAssembler,
              kept: list[int], broken_at: list[float]) -> str | None:
        """Feeds one chunk to the outbox; the finish reason once the request is done."""
        if broken_at and chunk.tokens:
            self._resumed_after(handle, broken_at.pop())
        handle.awaiting_kv = False
        if chunk.tokens:
            self._token_times(handle, len(chunk.tokens))
        sampling = handle.request.sampling
        tokens = chunk.tokens[:sampling.max_tokens - assembler.tokens]
        kept.extend(tokens)
        stop_token = (chunk.finish_reason == "stop" and tokens == chunk.tokens
                      and tokens[-1:] != [] and tokens[-1] in sampling.stop_token_ids)
        shown = tokens[:-1] if stop_token else tokens
        before = assembler.chars
        text = assembler.push(shown)
        assembler.skip(len(tokens) - len(shown))
        records = self._records(chunk, tokens, before, assembler.chars)
        handle.outbox.put(Delta(text, len(tokens), records))
        if assembler.stopped:
            return "stop"
        if assembler.tokens >= sampling.max_tokens:
            return chunk.finish_reason or "length"
        return chunk.finish_reason

    def _token_times(self, handle: RequestHandle, tokens: int) -> None:
        """The first and second tokens' times, and the gap before each later token (the ITL
        histogram): `tokens` arriving g after the last one count as `tokens` gaps of
        g / tokens (a whole answer's tokens after the first come together at its end)."""
        now = self.clock()
        if handle.first_token_at == 0.0:
            handle.first_token_at = handle.last_token_at = now
            self.phase(handle.placement.request_id, "decode", handle.placement.decode_worker)
            if handle.trace is not None:
                handle.trace.add_event("first_token")
            tokens -= 1
        if tokens > 0 and handle.second_token_at == 0.0:
            handle.second_token_at = now
        if tokens > 0 and handle.series is not None:
            handle.series.itl.observe((now - handle.last_token_at) / tokens, tokens)
        handle.last_token_at = now

    def _resumed_after(self, handle: RequestHandle, broken_at: float) -> None:
        """A migrated attempt's first token: the end of the gap its migration cost."""
        self._resumed += 1
        self._resume_s += self.clock() - broken_at
        self.phase(handle.placement.request_id, "decode", handle.placement.decode_worker,
                   f"attempt {handle.placement.attempt}")

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(migrations=dict(self._migrations), gave_up=self._gave_up,
                                resumed=self._resumed, resume_s=self._resume_s)

    def _records(self, chunk: TokenChunk, tokens: list[int], start: int,
                 end: int) -> tuple[TokenRecord, ...] | None:
        """The logprobs of `tokens` (a chunk's first ones), their text at [start, end)."""
        if chunk.logprobs is None:
            return None
        offsets = text_offsets(self.tokenizer, tokens, start, end)
        return tuple(TokenRecord(chat_entry(self.tokenizer, token, logprob), offset)
                     for token, logprob, offset in zip(tokens, chunk.logprobs, offsets,
                                                       strict=False))

    def phase(self, request_id: str, phase: Phase, worker: str, detail: str = "") -> None:
        if not self.events.subscribed:  # the dashboard's and the simulation's
            return
        self.events.publish(RequestPhase(ts=self.clock(), source="router", request_id=request_id,
                                         phase=phase, worker=worker, detail=detail))


async def _after_end(chunks: AsyncIterator[object]) -> str | None:
    """Reads a finished stream's End; the type of anything else after the last token (it
    breaks the protocol), None when the End came."""
    async for extra in chunks:
        return type(extra).__name__
    return None


def continued(sampling: Sampling, kept: int) -> Sampling:
    """The sampling of an attempt that continues after `kept` output tokens: as many fewer to
    go, and a seed that draws token i as the original draws token kept + i. A request with no
    seed drew its seed on the worker; its continuation draws afresh (still a draw from the
    model given the tokens so far)."""
    if kept == 0:
        return sampling
    seed = None if sampling.seed is None else continued_seed(sampling.seed, kept)
    return msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - kept,
                                   min_tokens=max(0, sampling.min_tokens - kept), seed=seed)


def breakage(broken: DataPathBroken, p: Placement) -> tuple[MigrationReason, str, bool] | None:
    """What broke (the reason, the worker whose side broke, whether its connection went), or
    None when a side met an error of the request itself (step 1 of the module docstring)."""
    prefill, decode = broken.prefill, broken.decode
    if not all(_breaks(side) for side in (prefill, decode) if side is not None):
        return None
    if isinstance(decode, PeerGone):
        return "decode_lost", p.decode_worker, True
    if isinstance(decode, KVStalled) or _remote(decode, "KVStalled") or _remote(
            prefill, "KVStalled"):
        return "kv_stalled", p.prefill_worker, False
    if isinstance(prefill, PeerGone):
        return "prefill_lost", p.prefill_worker, True
    if _remote(decode, "KVTransferError") or (decode is None
                                              and _remote(prefill, "KVTransferError")):
        return "kv_cut", p.prefill_worker, False
    if decode is not None:
        return "decode_lost", p.decode_worker, False
    return "prefill_lost", p.prefill_worker, False


def _breaks(error: Exception) -> bool:
    """Whether a side's error says the data path broke (a worker, a connection, a stream),
    not that the request is wrong or out of time."""
    if isinstance(error, RemoteError):
        return error.error in BREAKAGES
    return isinstance(error, PeerGone | StreamAborted | KVStalled) or (
        type(error) is UpstreamFailed)


def _remote(error: Exception | None, kind: str) -> bool:
    return isinstance(error, RemoteError) and error.error == kind


def _cluster_after(reason: MigrationReason, p: Placement) -> Cluster | None:
    """The kind of cluster a migrated request prefills in (step 3 of the module docstring)."""
    if reason == "decode_lost":
        return None
    if reason == "kv_stalled" or (reason == "kv_cut" and p.cluster == "prfaas"):
        return "pd"
    return p.cluster


@dataclass
class PrefixCacheTokens:
    """Prompt tokens of one cluster's prefills: looked up in its prefix cache, found there."""

    queried: int = 0
    hit: int = 0


class PrefixCacheCounters(Collector):
    """prfaas_prefix_cache_{query,hit}_tokens_total by the cluster that prefilled."""

    def __init__(self) -> None:
        self._clusters: dict[str, PrefixCacheTokens] = {}

    def of(self, cluster: str) -> PrefixCacheTokens:
        return self._clusters.setdefault(cluster, PrefixCacheTokens())

    def collect(self) -> Iterator[Metric]:
        queried = CounterMetricFamily("prfaas_prefix_cache_query_tokens", "Prompt tokens "
                                      "looked up in the prefill worker's prefix cache",
                                      labels=["cluster"])
        hit = CounterMetricFamily("prfaas_prefix_cache_hit_tokens", "Prompt tokens found in "
                                  "the prefill worker's prefix cache (not computed)",
                                  labels=["cluster"])
        for cluster, tokens in self._clusters.items():
            queried.add_metric([cluster], tokens.queried)
            hit.add_metric([cluster], tokens.hit)
        yield from (queried, hit)


# The per-request TPOT's name until this release: vLLM gives the name to the gap between
# tokens (ours is prfaas_inter_token_latency_seconds), so a vLLM operator read it wrong. The
# histogram is exported under both names for one release (docs/observability.md).
TPOT_ALIAS = "prfaas_time_per_output_token_seconds"


class RequestSeries(NamedTuple):
    """One (cluster, policy)'s children of every request histogram, looked up once."""

    ttft: HistogramSeries
    itl: HistogramSeries
    duration: HistogramSeries
    queue: HistogramSeries
    tpot: HistogramSeries
    prompt: HistogramSeries
    completion: HistogramSeries
    tpot_alias: HistogramSeries  # the same values under TPOT_ALIAS, for one release
    cache: PrefixCacheTokens  # the prefill cluster's, shared by its policies' series


class RequestMetrics(Collector):
    """The router's per-request histograms and prefix-cache counters (module docstring)."""

    def __init__(self) -> None:
        seconds = (
            ("prfaas_time_to_first_token_seconds", "Request sent to its first token"),
            ("prfaas_inter_token_latency_seconds", "Gap before each output token after the "
             "first (a chunk's gap spread over its tokens)"),
            ("prfaas_request_duration_seconds", "Request sent to its last token (completed "
             "requests)"),
            ("prfaas_request_queue_seconds", "Time a request waited at its prefill worker "
             "before its prefill began"),
            ("prfaas_request_time_per_output_token_seconds", "(duration - TTFT) / (completion "
             "tokens - 1), per completed request"),
        )
        tokens = (("prfaas_request_prompt_tokens", "Prompt length of completed requests"),
                  ("prfaas_request_generation_tokens", "Completion length of completed "
                   "requests"))
        alias = Histogram(TPOT_ALIAS, "Deprecated: the same as prfaas_request_time_per_output_"
                          "token_seconds (per request, not between tokens); removed in the "
                          "next release", REQUEST_LABELS, SECONDS_BUCKETS)
        self._histograms = [
            *(Histogram(name, doc, REQUEST_LABELS, SECONDS_BUCKETS) for name, doc in seconds),
            *(Histogram(name, doc, REQUEST_LABELS, TOKENS_BUCKETS) for name, doc in tokens),
            alias]
        self.cache = PrefixCacheCounters()
        self._series: dict[tuple[str, str], RequestSeries] = {}

    def series(self, cluster: str, policy: str) -> RequestSeries:
        """The children for requests prefilled in `cluster` and placed by `policy`."""
        key = (cluster, policy)
        found = self._series.get(key)
        if found is None:
            found = RequestSeries._make([*(h.labels(cluster, policy) for h in self._histograms),
                                         self.cache.of(cluster)])
            self._series[key] = found
        return found

    @staticmethod
    def finished(handle: RequestHandle, end: RequestEnd) -> None:
        """Observes a request's `end`: its first token and prefill whatever the outcome, its
        duration and lengths when it completed."""
        series, result = handle.series, end.result
        if series is None:
            return
        if end.ttft_s is not None:
            series.ttft.observe(end.ttft_s)
        if handle.prefill is not None:
            series.queue.observe(handle.prefill.queue_s)
            series.cache.queried += handle.prefill.prompt_tokens
            series.cache.hit += handle.prefill.reused_tokens
        if result is None:
            return
        series.duration.observe(end.e2e_s)
        series.prompt.observe(result.prompt_tokens)
        series.completion.observe(result.completion_tokens)
        if end.tpot_s is not None:
            series.tpot.observe(end.tpot_s)
            series.tpot_alias.observe(end.tpot_s)

    def histogram_exposition(self) -> str:
        """The histograms' text, as `collect` through a registry writes them but written
        directly: the router's /metrics appends it (scraped under load: bench_router.py
        --scrape-every); `cache` goes through the router's registry."""
        return "".join(histogram.exposition() for histogram in self._histograms)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield from histogram.collect()
        yield from self.cache.collect()
