"""The decode worker: takes a request's cache from its KV stream, joins the request to the
running batch, streams tokens back.

Two doors per request, opened in either order: the KV arrives as upload lanes from a prefill
worker (`inbox.receive`, one call per lane: services/worker/kv_in.py), the token stream is
opened by whoever asked (`decode`). Both meet at the request's `KVAssembly`. The decode side
then:

1. waits for the request's cache (`KVReceiver.cache`, services/worker/kv_in.py): every lane
   closed and the first token known, within `kv_timeout` and `kv_stall`, then the pieces
   imported on top of the KV this worker already holds for the prompt's first tokens; a lane
   cut off, a stream for another model or a stalled link fails the request with an explicit
   `KVTransferError` or `KVStalled`, and its pieces are let go;
2. joins the request to the `DecodeBatch`, which one loop task (`run`) steps in a worker
   thread while requests join and leave between steps (continuous batching);
3. streams `TokenChunk`s: each step's token at once, or, for a request that wants its text
   whole (`DecodeRequest.incremental` false: a non-streamed completion), the first token at
   once and the rest in one chunk at the finish (`Member`, below); when the request
   finishes, keeps its cache (prompt + output) in the prefix store and reports it, so a
   later turn needs only the new tokens' KV.

A member of the decode batch is one request's cache, its output, and its tokens' way out.
The batch loop hands each step's token to `Member.deliver`; the task that streams the request
to its reader takes them, as lists of events, from the member's mailbox (`tokens`) and sends
each list as one `TokenChunk` (`token_chunk`). A request that wants its text whole has its
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import anyio
import msgspec

from mesh import native
from mesh.events import EventBus
from mesh.mailbox import Mailbox
from services.contract.errors import DataPathError, RequestError
from services.contract.events import Event, RequestPhase
from services.contract.messages import DecodeRequest, TokenChunk
from services.contract.prefix import extend_chain
from services.contract.tracing import Tracer, failed
from services.model.batch import StepResult, TokenEvent, finish_reason, result_reason
from services.model.cache import RequestCache
from services.model.config import ModelError
from services.model.model import HybridLM
from services.model.sampling import SamplingParams
from services.worker.compute import Pacing
from services.worker.engine import Engine, as_engine
from services.worker.kv_in import KVInbox, KVReceiver
from services.worker.kv_metrics import KVTransferMetrics
from services.worker.prefix_store import PrefixStore, StoreChange
from services.worker.request_checks import check_decode

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
    # (services/cli/validate/profiles.py reads the ratio as the engine's speed in situ).
    step_seconds: float = 0.0
    step_sequences: int = 0
    step_context_tokens: int = 0


@dataclass
class _Counts:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    tokens: int = 0
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
        self._receiver = KVReceiver(self.inbox, self.model, store, tracer)
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
        """The request's tokens, chunk by chunk, once its KV is in (steps 1-3 above)."""
        params, hashes = check_decode(request, self.model.cfg.vocab_size,
                                      self.model.cfg.block_size)
        assembly = self.inbox.claim(request.request_id)
        self._counts.requests += 1
        self._enter()
        span = None if self._tracer is None or not request.trace else self._tracer.start(
            "decode", request.trace, {"prfaas.worker": self.config.name,
                                      "gen_ai.usage.input_tokens": len(request.prompt)},
            kind="server")
        try:
            cache = await self._receiver.cache(request, hashes, assembly, span)
            self.kv_metrics.imported(assembly)
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
                self._keep(request, hashes, [], cache)
                self._finish(request.request_id, reason)
                return
            async for chunk in self._tokens(request, hashes, cache, first, params, span):
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
            kv_bytes_in=inbox.bytes, reused_tokens=self._receiver.reused_tokens,
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

    async def _tokens(self, request: DecodeRequest, hashes: list[int], cache: RequestCache,
                      first: int, params: SamplingParams, span: Span | None = None
                      ) -> AsyncIterator[TokenChunk]:
        member = Member(request, hashes, cache, first, params, [first])
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
            self._keep(member.request, member.hashes, member.output, cache)
            self._finish(rid, result_reason(result, rid))
        if pacing is not None:
            modeled = pacing.decode_step_time(batch, context)
            await anyio.sleep(pacing.pacer.remaining(native.clock()() - started, modeled))

    def _fail_all(self, error: str) -> None:
        for rid, member in list(self._members.items()):
            self._batch.leave(rid)
            member.fail(error)
        self._members.clear()

    def _keep(self, request: DecodeRequest, hashes: list[int], output: list[int],
              cache: RequestCache) -> None:
        """Store the finished cache; it covers the first cache.length tokens of `request`'s
        prompt and `output`, whose prompt's blocks have the chain `hashes`. Only the tokens
        after those blocks are gathered and hashed, not the prompt and output joined."""
        block = self.model.cfg.block_size
        known = hashes[: cache.length // block]
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


def joined_slice(first: list[int], second: list[int], start: int, end: int) -> list[int]:
    """`(first + second)[start:end]` for 0 <= start <= end, without joining the two whole."""
    cut = len(first)
    return first[start:end] + second[max(0, start - cut) : max(0, end - cut)]



# A request that wants its tokens at the end gets them in chunks of at most this many events
# (a step's token each), so that a long generation never waits whole in one message.
HELD_TOKENS = 256


@dataclass
class Member:
    """One request in the batch: its cache, its output so far, the channel to its reader."""

    request: DecodeRequest
    hashes: list[int]  # the chain of its prompt's full blocks
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
