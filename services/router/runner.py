"""Runs a placed request to its end (`RequestRunner`) over the mesh, continuing it elsewhere when
its data path breaks (migration).

`drive` is the data path, the one request driver: the prefill call (`PrefillRequest` to the
prefill worker, which streams the KV the decode worker lacks straight to it) beside the decode
worker's token stream (`DecodeRequest`). The first error either side meets is the request's
(`DataPathBroken`, an `UpstreamFailed`) and cancels the other; cancelling the request's scope
(the client left) aborts the decode stream at its worker and gives up the prefill call. `prfaas
send` (services/cli/send.py) drives a prompt through two workers it names on the same `drive`.
`RequestRunner` runs a router's request on it: the tokens go through a `TextAssembler`
(services/router/text.py) into the request's outbox, with their logprobs when asked; a stop
token (stop_token_ids) counts but, as in vLLM, adds no text. The runner writes the request's
record (`RequestHandle`) as it runs.

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

Traces (services/contract/tracing.py, with tracing on): the scheduler gives a request its
span; the runner adds a span per attempt, whose traceparent the prefill and decode requests
carry to the workers, a span per migration, and the first token as an event.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import msgspec

from mesh import native
from mesh.errors import MeshError, PeerGone, RemoteError, StreamAborted
from mesh.events import EventBus
from mesh.node import Node
from services.contract.errors import KVStalled
from services.contract.events import Event, MigrationReason, RequestMigrated, RequestPhase
from services.contract.messages import DecodeRequest, PrefillDone, PrefillRequest, TokenChunk
from services.contract.sampling import Sampling
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
from services.router.requests import Delta, Finished, RequestHandle, broken_by_stall
from services.router.text import TextAssembler, TokenRecord, chat_entry, text_offsets
from services.router.workers import WorkerTable

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


class DataPathEnd(msgspec.Struct, frozen=True, kw_only=True):
    """How one request's data path ended: the prefill worker's report, the finish reason."""

    prefill: PrefillDone
    finish_reason: str


def _nothing() -> None:
    pass


async def drive(node: Node, prefill_worker: str, prefill: PrefillRequest, decode_worker: str,
                decode: DecodeRequest, *, timeout: float,
                on_chunk: Callable[[TokenChunk], str | None],
                on_prefilled: Callable[[], None] = _nothing, grace_s: float = 0.0) -> DataPathEnd:
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
    return DataPathEnd(prefill=done[0], finish_reason=reason)


async def _read_tokens(node: Node, worker: str, decode: DecodeRequest, timeout: float,
                       on_chunk: Callable[[TokenChunk], str | None],
                       failures: list[tuple[str, UpstreamFailed]]) -> str | None:
    """Feeds the decode worker's token stream to `on_chunk`; the finish reason it gave.
    The chunks are taken as they are delivered (`StreamReader.take_each`): this task wakes
    at the end, not for every chunk."""
    finished: list[tuple[str, str | None]] = []

    def feed(chunk: msgspec.Struct) -> bool:
        assert isinstance(chunk, TokenChunk)
        reason = on_chunk(chunk)
        if reason is not None:
            finished.append((reason, chunk.finish_reason))
        return reason is None

    try:
        async with node.open_stream(worker, decode, timeout=timeout) as chunks:
            if not await chunks.take_each(feed):
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



async def _after_end(chunks: AsyncIterator[object]) -> str | None:
    """Reads a finished stream's End; the type of anything else after the last token (it
    breaks the protocol), None when the End came."""
    async for extra in chunks:
        return type(extra).__name__
    return None


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
                       kept: list[int], broken_at: list[float]) -> DataPathEnd:
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
                    on_chunk=lambda chunk: self._feed(handle, chunk, assembler, kept, broken_at),
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
        raise handle.interrupted or broken_by_stall(p)

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

    def _feed(self, handle: RequestHandle, chunk: TokenChunk, assembler: TextAssembler,
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
