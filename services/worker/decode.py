"""The decode worker: receives a request's KV stream, joins the request to the running batch,
streams tokens back.

Two doors per request, opened in either order: the KV arrives as upload lanes from a prefill
worker (`inbox.receive`, one call per lane), the token stream is opened by whoever asked
(`decode`). Both meet at the request's `KVAssembly`. The decode side then:

1. waits (at most `kv_timeout`) until every lane has closed and the first token is known; a
   lane cut off mid-stream (the prefill worker died) or a stream for another model fails the
   request at once with an explicit `KVTransferError`, and KV that makes no progress for
   `kv_stall` seconds once its first lane opened (a stalled link) with `KVStalled`; either
   way its pieces are let go;
2. imports the pieces in a worker thread (the engine's `import_kv`: checksums and shapes
   checked per piece) on top of the KV it already holds for the prompt's first `start` tokens
   (its own prefix cache);
3. joins the request to the `DecodeBatch`, which one loop task (`run`) steps in a worker
   thread while requests join and leave between steps (continuous batching);
4. streams `TokenChunk`s: each step's token at once, or, for a request that wants its text
   whole (`DecodeRequest.incremental` false: a non-streamed completion), the first token at
   once and the rest in one chunk at the finish (`Member`, below); when the request
   finishes, keeps its cache (prompt + output) in the prefix store and reports it, so a
   later turn needs only the new tokens' KV.

The incoming KV (`KVInbox`): one `KVAssembly` per request, from its first upload lane or its
decode stream, whichever comes first, until the decode stream ends. Nothing is held for
nobody:
- a decode stream that ends (finished, failed or aborted) releases its request at once: the
  pieces go, and lanes of that request still uploading, or arriving later, are refused
  (`StreamAborted`, so the prefill worker stops sending) for `orphan_timeout` seconds;
- KV no decode stream claimed within `orphan_timeout` is dropped by `sweep_every`, a timer
  task, not by the next arrival;
- a lane that fails drops its request's pieces at once (the stream that waits learns why).
A prefill worker pulling a cached prefix (services/worker/prefix_pull.py) receives through
the same `KVInbox`.

`KVTransferMetrics`: the KV transfers a worker received, as Prometheus histograms:
`prfaas_kv_transfer_seconds` and `prfaas_kv_transfer_bytes`, labelled by the receiving service,
the link the KV crossed ("local" inside a cluster) and its kind: "full" (the decode worker held
none of the prompt), "incremental" (it held a prefix, so only the rest came), "prefix" (a cached
prefix pulled to a prefill worker). Seconds run from the first piece's arrival to the end of
the import, both on the receiver's clock: the sender's clock is another host's on a mesh
across hosts, so the first piece's one-way delay (the link's propagation delay, a few ms on
the default link) is left out. Bytes are the pieces' payload (the modeled size in the
simulation). The receiver observes: it alone knows when the KV was imported.

A member of the decode batch is one request's cache, its output, and its tokens' way out.
The batch loop hands each step's token to `Member.deliver`; the task
that streams the request to its reader takes them, as lists of events, from the member's
mailbox (`tokens`) and sends each list as one `TokenChunk` (`token_chunk`). A request that
wants its text whole (`DecodeRequest.incremental` false: a non-streamed completion) has its
tokens after the first held until its finish, or until `HELD_TOKENS` are held: two messages
for a short answer instead of one per step, on the worker's side and on the reader's.

With tracing on (services/contract/tracing.py) a decode stream whose request carries a
traceparent is a `decode` span, with the KV's arrival and import and the wait for a place in
the batch as children, and its first token as an event.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import anyio
import msgspec
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh import native
from mesh.errors import StreamAborted
from mesh.events import EventBus
from mesh.histogram import Histogram
from mesh.mailbox import Mailbox
from services.contract.errors import DataPathError, KVStalled, KVTransferError, RequestError
from services.contract.events import Event, RequestPhase
from services.contract.messages import (
    DecodeRequest,
    KVAccepted,
    KVChunk,
    KVClose,
    KVOpen,
    TokenChunk,
)
from services.contract.prefix import extend_chain
from services.contract.sampling import TokenLogprob
from services.contract.tracing import Tracer, failed
from services.model.batch import StepResult, TokenEvent, finish_reason, result_reason
from services.model.cache import RequestCache
from services.model.config import ModelError
from services.model.model import HybridLM
from services.model.sampling import SamplingParams
from services.service import BYTES_BUCKETS, SECONDS_BUCKETS
from services.worker.engine import (
    Engine,
    Pacing,
    as_engine,
    check_hashes,
    out_of_range,
    sampling_params,
)
from services.worker.prefix_store import PrefixStore, PrefixStoreError, StoreChange, prompt_hashes

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


class DecodeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    cluster: str = ""
    slots: int = 8  # initial batch capacity (it grows)
    # At most this many requests in the batch (0: no limit); the rest wait their turn. The
    # paper's BS_max: the largest batch whose step still meets the decode SLO.
    max_batch: int = 0
    # Decode streams served at once (the node's pool for them; the router admits at most the
    # sum over decode workers); more wait in that pool's queue, holding nothing else.
    max_streams: int = 64
    orphan_timeout: float = 120.0  # KV nobody asked to decode is dropped after this

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise RequestError(f"slots must be >= 1, got {self.slots}")
        if self.max_batch < 0:
            raise RequestError(f"max_batch must be >= 0, got {self.max_batch}")
        if self.max_streams < 1:
            raise RequestError(f"max_streams must be >= 1, got {self.max_streams}")
        if not self.orphan_timeout > 0:
            raise RequestError(f"orphan_timeout must be > 0, got {self.orphan_timeout}")


class DecodeStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset(
        {"requests", "finished", "failed", "tokens", "steps", "pieces_in", "kv_bytes_in",
         "reused_tokens", "kv_orphans_dropped", "kv_lanes_refused", "step_seconds",
         "step_sequences", "step_context_tokens"}
    )

    running: int  # in the batch
    waiting: int  # waiting for KV or importing
    assemblies: int
    requests: int
    finished: int
    failed: int
    tokens: int
    steps: int
    pieces_in: int
    kv_bytes_in: int
    reused_tokens: int
    kv_pending_bytes: int = 0  # KV pieces held, not yet imported (assemblies: their requests)
    kv_orphans_dropped: int = 0  # KV no decode stream claimed within orphan_timeout
    kv_lanes_refused: int = 0  # KV lanes of requests whose decode stream had ended
    # The engine's own steps as this worker times them (a real engine's; a modeled one's
    # are not timed): seconds in them, and the sums of their batch sizes and of the tokens
    # their batches held. Over a window, a linear step profile's prediction for the same
    # steps is fixed * steps + per_sequence * step_sequences + per_token * step_context_tokens
    # (services/cli/validation.py reads the ratio as the engine's speed in situ).
    step_seconds: float = 0.0
    step_sequences: int = 0
    step_context_tokens: int = 0


@dataclass
class _Counts:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    tokens: int = 0
    reused_tokens: int = 0
    step_seconds: float = 0.0
    step_sequences: int = 0
    step_context_tokens: int = 0


class DecodeWorker:
    """Continuous-batching decode over `model`; run `run()` in a task group beside it."""

    def __init__(
        self,
        model: HybridLM | Engine,
        store: PrefixStore,
        config: DecodeConfig,
        *,
        bus: EventBus[Event] | None = None,
        pacing: Pacing | None = None,
        report: Callable[[StoreChange], None] | None = None,
        kv_metrics: KVTransferMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.model = as_engine(model)
        self._tracer = tracer  # None: tracing is off (services/contract/tracing.py)
        self.store = store
        self.config = config
        self.kv_metrics = kv_metrics or KVTransferMetrics(config.name)
        self._bus = bus or EventBus()
        self._pacing = pacing
        self._report = report
        self._batch = self.model.new_batch(config.slots)
        self._members: dict[str, Member] = {}
        self._joining: list[Member] = []
        self._leaving: set[str] = set()
        cfg = self.model.cfg
        model_id = (cfg.family, cfg.config_hash(), self.model.dtype_name)
        self.inbox = KVInbox(config.name, model_id, config.orphan_timeout)
        self._waiting = 0
        # The batch loop sleeps on this alarm, idle or inside a modeled multi-step run; a join
        # or a leave wakes it.
        self._wakeup = native.Alarm()
        self._idle = anyio.Event()
        self._idle.set()
        self._counts = _Counts()

    @property
    def busy(self) -> int:
        """Requests waiting for KV, importing, joining or in the batch."""
        return self._waiting + len(self._members) + len(self._joining)

    @property
    def running(self) -> int:
        """Requests in the batch (what `statistics` reports, without building it)."""
        return len(self._members)

    @property
    def waiting(self) -> int:
        """Requests waiting for their KV, importing it, or waiting to join the batch."""
        return self._waiting + len(self._joining)

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """The request's tokens, chunk by chunk, once its KV is in (steps 1-4 above)."""
        params = _check_decode(request, self.model.cfg.vocab_size, self.model.cfg.block_size)
        assembly = self.inbox.claim(request.request_id)
        self._counts.requests += 1
        self._enter()
        span = None if self._tracer is None or not request.trace else self._tracer.start(
            "decode", request.trace, {"prfaas.worker": self.config.name,
                                      "gen_ai.usage.input_tokens": len(request.prompt)},
            kind="server")
        try:
            cache = await (self._await_kv(request, assembly) if span is None
                           else self._traced_kv(request, assembly, span))
            first = assembly.first_token
            assert first is not None and assembly.opening is not None
            reason = finish_reason(first, 1, params, self.model.cfg.eos_id)
            self._phase(request.request_id, "decode")
            logprob = assembly.first_logprob
            if span is not None:
                span.add_event("first_token")
            yield TokenChunk(request_id=request.request_id, tokens=[first], index=0,
                             finish_reason=reason, reused_tokens=assembly.opening.start,
                             logprobs=None if logprob is None else [logprob])
            if reason is not None:
                self._keep(request, [], cache)
                self._finish(request.request_id, reason)
                return
            async for chunk in self._tokens(request, cache, first, params, span):
                yield chunk
        except BaseException as exc:
            self._counts.failed += 1
            self._phase(request.request_id, "failed", f"{type(exc).__name__}: {exc}")
            if span is not None:
                failed(span, exc)
            raise
        finally:
            self.inbox.release(request.request_id)
            self._drop_member(request.request_id)
            self._leave()
            if span is not None:
                span.end()

    async def run(self) -> None:
        """The batch loop, and the inbox's orphan timer beside it; forever."""
        async with anyio.create_task_group() as group:
            group.start_soon(self.inbox.sweep_every, self.config.orphan_timeout / 4)
            await self._loop()

    async def _loop(self) -> None:
        """The batch loop: admit joins and leaves, step, hand out tokens; forever."""
        try:
            while True:
                self._admit()
                if not self._members:
                    await self._wakeup.sleep_until(math.inf)
                    continue
                await self._step()
        finally:
            for member in [*self._members.values(), *self._joining]:
                member.fail(f"decode worker {self.config.name} stopped")

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def statistics(self) -> DecodeStatistics:
        batch, inbox = self._batch.statistics(), self.inbox.statistics()
        return DecodeStatistics(
            running=self.running, waiting=self.waiting,
            assemblies=inbox.assemblies, requests=self._counts.requests,
            finished=self._counts.finished, failed=self._counts.failed,
            tokens=self._counts.tokens, steps=batch.steps, pieces_in=inbox.pieces,
            kv_bytes_in=inbox.bytes, reused_tokens=self._counts.reused_tokens,
            kv_pending_bytes=inbox.held_bytes, kv_orphans_dropped=inbox.orphans_dropped,
            kv_lanes_refused=inbox.refused_lanes, step_seconds=self._counts.step_seconds,
            step_sequences=self._counts.step_sequences,
            step_context_tokens=self._counts.step_context_tokens,
        )

    def check_integrity(self) -> None:
        self._batch.check_integrity()
        if sorted(self._batch.request_ids()) != sorted(self._members):
            raise RequestError(f"batch {self._batch.request_ids()} != members "
                               f"{sorted(self._members)}")

    async def _await_kv(self, request: DecodeRequest, assembly: KVAssembly) -> RequestCache:
        await _kv_arrival(request, assembly, native.now() + request.kv_timeout)
        if assembly.failure is not None:
            raise assembly.failure
        if not assembly.ready:
            raise KVTransferError(
                f"no complete KV for {request.request_id!r} within kv_timeout="
                f"{request.kv_timeout} s ({len(assembly.pieces)} pieces arrived)"
            )
        return await self._import(request, assembly)

    async def _traced_kv(self, request: DecodeRequest, assembly: KVAssembly,
                         span: Span) -> RequestCache:
        """`_await_kv` in a `decode.kv` span: the KV's arrival on every lane, and its import."""
        assert self._tracer is not None
        with self._tracer.span("decode.kv", span) as kv:
            cache = await self._await_kv(request, assembly)
            opening = assembly.opening
            kv.set_attributes({"prfaas.kv.bytes": assembly.received_bytes,
                               "prfaas.kv.from": assembly.peer,
                               "prfaas.kv.reused_tokens": opening.start if opening else 0})
            return cache

    async def _import(self, request: DecodeRequest, assembly: KVAssembly) -> RequestCache:
        opening = assembly.opening
        assert opening is not None
        if opening.end != len(request.prompt):
            raise KVTransferError(f"KV of {request.request_id!r} covers {opening.end} tokens, "
                                  f"the prompt has {len(request.prompt)}")
        if not 0 <= opening.start < opening.end:
            # The last token is always computed: its logits give the first output token.
            raise KVTransferError(f"KV of {request.request_id!r} starts at token "
                                  f"{opening.start}, not below the prompt's {opening.end}")
        base = self._base(request, opening.start)
        cache: RequestCache = await self.model.import_kv(opening, base, assembly.pieces)
        self.kv_metrics.imported(assembly)
        assembly.free()
        self._counts.reused_tokens += opening.start
        return cache

    def _base(self, request: DecodeRequest, start: int) -> RequestCache | None:
        if start == 0:
            return None
        block = self.model.cfg.block_size
        hashes = prompt_hashes(request.prompt[:start], block, request.hashes[: start // block])
        try:
            return self.store.kv_base(hashes, start // block)
        except PrefixStoreError as exc:
            raise KVTransferError(f"KV of {request.request_id!r} starts at token {start}, "
                                  f"but {exc}") from exc

    async def _tokens(self, request: DecodeRequest, cache: RequestCache, first: int,
                      params: SamplingParams, span: Span | None = None
                      ) -> AsyncIterator[TokenChunk]:
        member = Member(request, cache, first, params, [first])
        if span is not None and self._tracer is not None:
            # Waiting for a place in the batch (max_batch), ended as the loop admits it.
            member.queued = self._tracer.start("decode.queue", span)
        self._joining.append(member)
        self._waiting -= 1
        self._wakeup.wake()
        try:
            async for events in member.tokens:
                yield token_chunk(request.request_id, events)
        finally:
            member.tokens.close()  # the reader has gone: the loop's next delivery says so
            self._waiting += 1
            if span is not None:
                span.set_attributes({"gen_ai.usage.output_tokens": len(member.output)})
        if member.error is not None:
            raise DataPathError(member.error)

    def _drop_member(self, request_id: str) -> None:
        """The reader has gone: the loop drops the request between two steps."""
        if request_id in self._members or any(
            m.request.request_id == request_id for m in self._joining
        ):
            self._leaving.add(request_id)
            self._wakeup.wake()

    def _admit(self) -> None:
        waiting: list[Member] = []
        for member in self._joining:
            rid = member.request.request_id
            if rid in self._leaving:
                member.end()
                continue
            if self.config.max_batch and len(self._members) >= self.config.max_batch:
                waiting.append(member)
                continue
            try:
                self._batch.join(rid, member.cache, member.first_token, member.params)
            except ModelError as exc:
                member.fail(f"{rid!r} could not join the batch: {exc}")
                continue
            if member.queued is not None:
                member.queued.end()
            self._members[rid] = member
        self._joining = waiting
        if self._leaving:
            # Readers seldom leave early: the batch's ids are not copied to a set at every
            # pass for none.
            for rid in self._leaving & set(self._members):
                self._batch.leave(rid)
                self._members.pop(rid).end()
            self._leaving.clear()
        self._check_idle()

    async def _step(self) -> None:
        # Clock and context are read only for a real engine's step: timed (statistics'
        # step_seconds), and paced in emulated mode. A modeled engine's steps are neither.
        timed = not self.model.paces_decode
        pacing = self._pacing if timed else None
        batch = len(self._batch)
        if timed:
            started, context = native.clock()(), self._batch.statistics().tokens_in_cache
        try:
            # A join wakes the alarm: that cuts a modeled multi-step short.
            result: StepResult = await self.model.step(self._batch, self._wakeup)
        except ModelError as exc:
            log.exception("decode step failed; failing its %d requests", batch)
            self._fail_all(f"decode step failed: {exc}")
            return
        if timed:
            self._counts.step_seconds += native.clock()() - started
            self._counts.step_sequences += batch
            self._counts.step_context_tokens += context
        self._counts.tokens += sum(event.count for event in result.events)
        for event in result.events:
            member = self._members[event.request_id]
            member.output.extend([event.token] * event.count)
            if not member.deliver(event):
                self._leaving.add(event.request_id)
        for rid, cache in result.finished.items():
            member = self._members.pop(rid)
            member.end()
            self._keep(member.request, member.output, cache)
            self._finish(rid, result_reason(result, rid))
        if pacing is not None:
            modeled = pacing.decode_step_time(batch, context)
            await anyio.sleep(pacing.pacer.remaining(native.clock()() - started, modeled))

    def _fail_all(self, error: str) -> None:
        for rid, member in list(self._members.items()):
            self._batch.leave(rid)
            member.fail(error)
        self._members.clear()

    def _keep(self, request: DecodeRequest, output: list[int], cache: RequestCache) -> None:
        """Store the finished cache; it covers the first cache.length tokens of `request`'s
        prompt and `output`, whose first blocks' chain the request brought. Only the tokens
        after those blocks are gathered and hashed, not the prompt and output joined."""
        block = self.model.cfg.block_size
        known = request.hashes[: cache.length // block]
        tail = joined_slice(request.prompt, output, len(known) * block, cache.length)
        change = self.store.store(extend_chain(known, tail, block), cache)
        if self._report is not None:
            self._report(change)

    def _finish(self, request_id: str, reason: str) -> None:
        self._counts.finished += 1
        self._phase(request_id, "finished", reason)

    def _enter(self) -> None:
        self._waiting += 1
        if self._idle.is_set():
            self._idle = anyio.Event()

    def _leave(self) -> None:
        self._waiting -= 1
        self._check_idle()

    def _check_idle(self) -> None:
        if self.busy == 0:
            self._idle.set()

    def _phase(self, request_id: str, phase: str, detail: str = "") -> None:
        if not self._bus.subscribed:  # the dashboard's: not built for nobody
            return
        self._bus.publish(RequestPhase(
            ts=native.clock()(), source=self.config.name, request_id=request_id,
            phase=phase,  # type: ignore[arg-type]
            worker=self.config.name, detail=detail,
        ))


async def _kv_arrival(request: DecodeRequest, assembly: KVAssembly,
                      deadline: float) -> None:
    """Until the KV is whole or failed, or `deadline` (the caller tells which); KVStalled
    once, after its first lane opened, it made no progress (no lane opened, no piece
    arrived) for `request.kv_stall` seconds. Before the first lane the job may wait in the
    prefill worker's queue: that worker bounds the KV's arrival after its compute
    (PrefillRequest.kv_stall). The caller releases the assembly, so late lanes are refused."""
    if not request.kv_stall > 0:
        await assembly.wait(deadline)
        return
    while not assembly.finished and native.now() < deadline:
        since = assembly.progress_at
        # Pieces and lane openings do not wake the waiter (a wake-up per piece would cost):
        # it looks again when the bound would pass, and goes on if one came meanwhile.
        wake = since if assembly.opening is not None else native.now()
        await assembly.wait(min(deadline, wake + request.kv_stall))
        # At the deadline itself the caller's timeout speaks, not the stall.
        if assembly.opening is not None and not assembly.finished and (
                assembly.progress_at == since) and native.now() < deadline:
            raise KVStalled(
                f"the KV of {request.request_id!r} made no progress for kv_stall="
                f"{request.kv_stall:g} s ({len(assembly.pieces)} pieces arrived)")


def joined_slice(first: list[int], second: list[int], start: int, end: int) -> list[int]:
    """`(first + second)[start:end]` for 0 <= start <= end, without joining the two whole."""
    cut = len(first)
    return first[start:end] + second[max(0, start - cut) : max(0, end - cut)]


def _check_decode(request: DecodeRequest, vocab: int, block: int) -> SamplingParams:
    if not request.prompt:
        raise RequestError("prompt must hold at least one token, got 0")
    bad = out_of_range(request.prompt, vocab)
    if bad is not None:
        raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad}")
    check_hashes(request.prompt, block, request.hashes)
    if not request.kv_timeout > 0:
        raise RequestError(f"kv_timeout must be > 0 seconds, got {request.kv_timeout}")
    if request.kv_stall < 0:
        raise RequestError(f"kv_stall must be >= 0 seconds, got {request.kv_stall}")
    return sampling_params(request.sampling)


# A received piece is a view of the frame it came in (KVChunk.data); a small piece that shares
# a large read with other frames would keep the whole read alive unaccounted, so it is copied.
_VIEW_SLACK = 64 * 1024


def _owned(data: memoryview) -> memoryview:
    """`data` itself when its buffer is about its size, else a copy of just its bytes."""
    view = memoryview(data)
    base = view.obj
    size = len(base) if isinstance(base, bytes | bytearray) else view.nbytes
    if size > 2 * view.nbytes + _VIEW_SLACK:
        return memoryview(bytes(view))
    return view


class KVAssembly:
    """One request's incoming KV: the lanes' pieces, the first token, or why it failed."""

    def __init__(self, request_id: str, created: float) -> None:
        self.request_id = request_id
        self.created = created
        self.claimed = False
        self.opening: KVOpen | None = None
        self.pieces: dict[tuple[int, int], memoryview] = {}  # (layer, start) -> encoded piece
        self.nbytes = 0  # of `pieces`
        self.first_token: int | None = None
        self.first_logprob: TokenLogprob | None = None
        self.failure: KVTransferError | None = None
        self.gone = False  # released or dropped: its lanes are refused
        self.peer = "?"  # the sending node (`KVTransferMetrics`: its link)
        self.first_piece_at: float | None = None
        self.received_bytes = 0  # pieces' payload, kept after `free` (the transfer's size)
        self.progress_at = created  # when a lane last opened or closed or a piece arrived
        self._closed: set[int] = set()
        self._opened: set[int] = set()
        # Its one waiter (a decode stream, or a prefix pull: `KVInbox.claim` lets one claim
        # it) sleeps on this alarm until a change or its deadline: no cancel scope per wait.
        self._changed = native.Alarm()

    @property
    def ready(self) -> bool:
        lanes = self.opening.lanes if self.opening else -1
        return len(self._closed) == lanes and self.first_token is not None

    @property
    def finished(self) -> bool:
        return self.ready or self.failure is not None

    def open_lane(self, opening: KVOpen) -> None:
        first = self.opening or opening
        for name in ("start", "end", "lanes", "config_hash", "dtype"):
            if getattr(first, name) != getattr(opening, name):
                raise KVTransferError(f"lane {opening.lane} of {self.request_id!r}: {name}="
                                      f"{getattr(opening, name)!r}, an earlier lane said "
                                      f"{getattr(first, name)!r}")
        if not 0 <= opening.lane < opening.lanes or opening.lane in self._opened:
            raise KVTransferError(f"lane must be a new lane in [0, {opening.lanes}), got "
                                  f"{opening.lane} for {self.request_id!r}")
        self.opening = first
        self._opened.add(opening.lane)
        self.progress_at = native.clock()()

    def add(self, chunk: KVChunk) -> None:
        key = (chunk.layer, chunk.start)
        if key in self.pieces:
            raise KVTransferError(f"piece (layer {chunk.layer}, start {chunk.start}) of "
                                  f"{self.request_id!r} arrived twice")
        self.pieces[key] = _owned(chunk.data)
        self.nbytes += len(chunk.data)
        self.received_bytes += chunk.size
        now = self.progress_at = native.clock()()
        if self.first_piece_at is None:
            self.first_piece_at = now

    def close_lane(self, lane: int) -> None:
        self._closed.add(lane)
        self.progress_at = native.clock()()
        self._signal()

    def fail(self, error: KVTransferError) -> None:
        if self.failure is None:
            self.failure = error
        self.free()
        self._signal()

    def free(self) -> None:
        """Lets go of the pieces (imported, or never to be)."""
        self.pieces = {}
        self.nbytes = 0

    async def wait(self, deadline: float = math.inf) -> None:
        """Until the KV is whole or failed, or until `deadline` on the loop's clock."""
        while not self.finished and native.now() < deadline:
            await self._changed.sleep_until(deadline)

    def _signal(self) -> None:
        self._changed.wake()


class KVInboxStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset(
        {"lanes", "pieces", "bytes", "failed_lanes", "orphans_dropped", "refused_lanes"})

    assemblies: int  # requests whose KV or decode stream is here
    lanes: int
    pieces: int
    bytes: int
    failed_lanes: int
    held_bytes: int = 0  # piece bytes held now (not yet imported)
    orphans_dropped: int = 0  # assemblies no decode stream claimed in time
    refused_lanes: int = 0  # lanes of a request whose decode stream had already ended


class KVInbox:
    """A decode worker's incoming KV streams (module docstring); run `sweep_every` beside."""

    def __init__(self, name: str, model: tuple[str, str, str], orphan_timeout: float) -> None:
        if not orphan_timeout > 0:
            raise RequestError(f"orphan_timeout must be > 0 seconds, got {orphan_timeout}")
        self.name = name
        self.model = model  # (family, config_hash, dtype) the worker accepts
        self.orphan_timeout = orphan_timeout
        self._assemblies: dict[str, KVAssembly] = {}
        self._gone: dict[str, float] = {}  # released request -> when
        self._counts = dict.fromkeys(("lanes", "pieces", "bytes", "failed_lanes",
                                      "orphans_dropped", "refused_lanes"), 0)

    def expects(self, request_id: str) -> bool:
        """True when a decode stream for `request_id` is open and waits for its KV."""
        assembly = self._assemblies.get(request_id)
        return assembly is not None and assembly.claimed

    async def receive(self, opening: KVOpen, items: AsyncIterator[msgspec.Struct],
                      peer: str = "?") -> KVAccepted:
        """One upload lane: check it is for this model, collect its pieces, close it."""
        self._refuse_if_gone(opening.request_id)
        assembly = self._assembly(opening.request_id)
        assembly.peer = peer
        count = nbytes = 0
        try:
            self._check_model(opening)
            assembly.open_lane(opening)

            def take(item: msgspec.Struct) -> None:
                nonlocal count, nbytes
                size = self._take(assembly, opening, item)
                count, nbytes = count + 1, nbytes + size

            if isinstance(items, Mailbox):
                # Each piece is taken in the task that delivers it (Mailbox.take_each): the
                # handler wakes once, at the lane's end, not once per piece.
                await items.take_each(take)
            else:
                async for item in items:
                    take(item)
            expected = opening.pieces + (opening.lane == 0)
            if count != expected:
                raise KVTransferError(f"lane {opening.lane} of {opening.request_id!r} ended "
                                      f"after {count} items, expected {expected}")
            assembly.close_lane(opening.lane)
        except BaseException as exc:
            self._counts["failed_lanes"] += 1
            assembly.fail(lane_error(exc, opening, peer, count))
            raise
        self._counts["lanes"] += 1
        return KVAccepted(request_id=opening.request_id, lane=opening.lane, pieces=count,
                          bytes=nbytes)

    def claim(self, request_id: str) -> KVAssembly:
        """The assembly a decode stream waits on; RequestError if another stream has it."""
        if request_id in self._gone:
            raise RequestError(f"request_id {request_id!r} has already been decoded here")
        assembly = self._assembly(request_id)
        if assembly.claimed:
            raise RequestError(f"request_id {request_id!r} is already being decoded")
        assembly.claimed = True
        return assembly

    def release(self, request_id: str) -> None:
        """The decode stream ended: free the request's KV now and refuse its late lanes."""
        assembly = self._assemblies.pop(request_id, None)
        if assembly is not None:
            self._retire(assembly)

    def sweep(self) -> None:
        """Drops KV no decode stream claimed within `orphan_timeout`, and forgets requests
        released as long ago."""
        cutoff = native.clock()() - self.orphan_timeout
        for rid in [r for r, a in self._assemblies.items() if not a.claimed and a.created < cutoff]:
            log.warning("dropping the KV of %r: no decode stream asked for it within %g s",
                        rid, self.orphan_timeout)
            self._counts["orphans_dropped"] += 1
            self._retire(self._assemblies.pop(rid))
        for rid in [r for r, when in self._gone.items() if when < cutoff]:
            del self._gone[rid]

    async def sweep_every(self, period: float) -> None:
        """The orphan timer: `sweep` every `period` seconds, forever."""
        while True:
            await anyio.sleep(period)
            self.sweep()

    def statistics(self) -> KVInboxStatistics:
        held = sum(a.nbytes for a in self._assemblies.values())
        return KVInboxStatistics(assemblies=len(self._assemblies), held_bytes=held,
                                 **self._counts)

    def _retire(self, assembly: KVAssembly) -> None:
        assembly.gone = True
        assembly.free()
        self._gone[assembly.request_id] = native.clock()()

    def _refuse_if_gone(self, request_id: str) -> None:
        if request_id in self._gone:
            self._counts["refused_lanes"] += 1
            raise StreamAborted(f"the decode stream of {request_id!r} has ended on {self.name}; "
                                "its KV is not wanted")

    def _check_model(self, opening: KVOpen) -> None:
        theirs = (opening.family, opening.config_hash, opening.dtype)
        if theirs != self.model:
            raise KVTransferError(
                f"KV stream of {opening.request_id!r} is for model (family, config_hash, "
                f"dtype)={theirs}, but {self.name} serves {self.model}"
            )

    def _take(self, assembly: KVAssembly, opening: KVOpen, item: msgspec.Struct) -> int:
        if assembly.gone:
            self._counts["refused_lanes"] += 1
            raise StreamAborted(f"the KV of {opening.request_id!r} was let go on {self.name} "
                                "while it arrived")
        if isinstance(item, KVChunk):
            assembly.add(item)
            self._counts["pieces"] += 1
            self._counts["bytes"] += item.size
            return item.size
        if isinstance(item, KVClose) and opening.lane == 0:
            assembly.first_token = item.first_token
            assembly.first_logprob = item.first_logprob
            return 0
        raise KVTransferError(f"lane {opening.lane} of {opening.request_id!r} carried an "
                              f"unexpected {type(item).__name__}")

    def _assembly(self, request_id: str) -> KVAssembly:
        assembly = self._assemblies.get(request_id)
        if assembly is None:
            assembly = KVAssembly(request_id, native.clock()())
            self._assemblies[request_id] = assembly
        return assembly


def lane_error(exc: BaseException, opening: KVOpen, peer: str, count: int) -> KVTransferError:
    """What a decode stream is told when one of its KV lanes broke."""
    if isinstance(exc, KVTransferError):
        return exc
    return KVTransferError(
        f"KV lane {opening.lane} of {opening.request_id!r} from {peer} was cut off after "
        f"{count} of {opening.pieces + (opening.lane == 0)} items: "
        f"{type(exc).__name__}: {exc or 'cancelled'}"
    )


LABELS = ("service", "link", "kind")
LOCAL = "local"


class KVTransferMetrics(Collector):
    """One worker's KV-transfer histograms (module docstring); `imported` after each import."""

    def __init__(self, service: str,
                 link_of: Callable[[str], str | None] = lambda peer: None) -> None:
        self.service = service
        self._link_of = link_of
        self.seconds = Histogram("prfaas_kv_transfer_seconds", "KV transfer time, first piece "
                                 "received to the last imported", LABELS, SECONDS_BUCKETS)
        self.bytes = Histogram("prfaas_kv_transfer_bytes", "KV bytes of one transfer",
                               LABELS, BYTES_BUCKETS)

    def imported(self, assembly: KVAssembly) -> None:
        """Observes the transfer `assembly` held, imported just now."""
        opening = assembly.opening
        if opening is None:
            return
        kind = "prefix" if opening.purpose == "prefix" else (
            "incremental" if opening.start > 0 else "full")
        labels = (self.service, self._link_of(assembly.peer) or LOCAL, kind)
        started = assembly.first_piece_at if assembly.first_piece_at is not None \
            else assembly.created
        self.seconds.labels(*labels).observe(native.clock()() - started)
        self.bytes.labels(*labels).observe(assembly.received_bytes)

    def collect(self) -> Iterator[Metric]:
        yield from self.seconds.collect()
        yield from self.bytes.collect()


# A request that wants its tokens at the end gets them in chunks of at most this many events
# (a step's token each), so that a long generation never waits whole in one message.
HELD_TOKENS = 256


@dataclass
class Member:
    """One request in the batch: its cache, its output so far, the channel to its reader."""

    request: DecodeRequest
    cache: RequestCache
    first_token: int
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    error: str | None = None
    held: list[TokenEvent] = field(default_factory=list)
    # What the loop has handed out and the reader has not sent yet; its reader drains a
    # backlog without a trip through the event loop per item, so a burst leaves in one write.
    tokens: Mailbox[list[TokenEvent]] = field(default_factory=lambda: Mailbox(sys.maxsize))
    # Its `decode.queue` span while it waits to join the batch (traced requests only).
    queued: Span | None = None

    def deliver(self, event: TokenEvent) -> bool:
        """Hands a token to the reader, or holds it for a request that wants its tokens at
        the end (module docstring); False when the reader has gone."""
        held = self.held
        held.append(event)
        if (not self.request.incremental and event.finish_reason is None
                and len(held) < HELD_TOKENS):
            return True
        self.held = []
        return self.tokens.put_nowait(held)

    def end(self) -> None:
        """No more tokens: the reader sends what is queued, then ends."""
        self.tokens.end()

    def fail(self, error: str) -> None:
        self.error = error
        self.tokens.end()


def token_chunk(request_id: str, events: list[TokenEvent]) -> TokenChunk:
    """One chunk of consecutive token events (an event of `count` stands for its token
    repeated; its logprob, if any, is the one given for it)."""
    if len(events) == 1:
        event = events[0]
        tokens = [event.token] * event.count
        logprobs = None if event.logprob is None else [event.logprob]
    else:
        tokens = [event.token for event in events for _ in range(event.count)]
        given = [event.logprob for event in events if event.logprob is not None]
        logprobs = given or None
    return TokenChunk(request_id=request_id, tokens=tokens, index=events[0].index,
                      finish_reason=events[-1].finish_reason, logprobs=logprobs)
