"""The KV stream into a decode worker: a request's pieces collected from its upload lanes,
then imported into its cache.

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

`KVReceiver.cache`: a decode stream's way from its assembly to its cache. It waits (at most
`kv_timeout`) until every lane has closed and the first token is known; a lane cut off
mid-stream (the prefill worker died) or a stream for another model fails the request at once
with an explicit `KVTransferError`, and KV that makes no progress for `kv_stall` seconds once
its first lane opened (a stalled link) with `KVStalled`. It then imports the pieces in a worker
thread (the engine's `import_kv`: checksums and shapes checked per piece) on top of the KV the
worker already holds for the prompt's first `start` tokens (its own prefix cache).

The prefill worker's side of the stream is services/worker/kv_out.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, ClassVar

import anyio
import msgspec

from mesh import native
from mesh.errors import StreamAborted
from mesh.mailbox import Mailbox
from services.contract.errors import KVStalled, KVTransferError, RequestError
from services.contract.messages import DecodeRequest, KVAccepted, KVChunk, KVClose, KVOpen
from services.contract.sampling import TokenLogprob
from services.contract.tracing import Tracer
from services.model.cache import RequestCache
from services.worker.engine import Engine
from services.worker.prefix_store import PrefixStore, PrefixStoreError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


class KVReceiver:
    """A decode worker's requests' KV, from the inbox's assembly to the imported cache (module
    docstring); `reused_tokens`: tokens the imports found in the worker's own store."""

    def __init__(self, inbox: KVInbox, engine: Engine, store: PrefixStore,
                 tracer: Tracer | None) -> None:
        self.inbox = inbox
        self.engine = engine
        self.store = store
        self._tracer = tracer
        self.reused_tokens = 0

    async def cache(self, request: DecodeRequest, hashes: Sequence[int], assembly: KVAssembly,
                    span: Span | None) -> RequestCache:
        """The request's cache once its KV is in (`hashes`: its prompt's block chain); in a
        `decode.kv` span when traced: the KV's arrival on every lane, and its import."""
        with self._kv_span(span) as kv:
            cache = await self._await_kv(request, hashes, assembly)
            if kv is not None:
                opening = assembly.opening
                kv.set_attributes({"prfaas.kv.bytes": assembly.received_bytes,
                                   "prfaas.kv.from": assembly.peer,
                                   "prfaas.kv.reused_tokens": opening.start if opening else 0})
            return cache

    def _kv_span(self, span: Span | None) -> AbstractContextManager[Span | None]:
        if span is None or self._tracer is None:
            return nullcontext()
        return self._tracer.span("decode.kv", span)

    async def _await_kv(self, request: DecodeRequest, hashes: Sequence[int],
                        assembly: KVAssembly) -> RequestCache:
        await kv_arrival(request, assembly, native.now() + request.kv_timeout)
        if assembly.failure is not None:
            raise assembly.failure
        if not assembly.ready:
            raise KVTransferError(
                f"no complete KV for {request.request_id!r} within kv_timeout="
                f"{request.kv_timeout} s ({len(assembly.pieces)} pieces arrived)"
            )
        return await self._import(request, hashes, assembly)

    async def _import(self, request: DecodeRequest, hashes: Sequence[int],
                      assembly: KVAssembly) -> RequestCache:
        opening = assembly.opening
        assert opening is not None
        if opening.end != len(request.prompt):
            raise KVTransferError(f"KV of {request.request_id!r} covers {opening.end} tokens, "
                                  f"the prompt has {len(request.prompt)}")
        if not 0 <= opening.start < opening.end:
            # The last token is always computed: its logits give the first output token.
            raise KVTransferError(f"KV of {request.request_id!r} starts at token "
                                  f"{opening.start}, not below the prompt's {opening.end}")
        base = self._base(request.request_id, hashes, opening.start)
        cache: RequestCache = await self.engine.import_kv(opening, base, assembly.pieces)
        assembly.free()
        self.reused_tokens += opening.start
        return cache

    def _base(self, request_id: str, hashes: Sequence[int], start: int) -> RequestCache | None:
        """The KV this worker holds for the prompt's first `start` tokens (none from 0)."""
        if start == 0:
            return None
        blocks = start // self.engine.cfg.block_size
        try:
            return self.store.kv_base(hashes[:blocks], blocks)
        except PrefixStoreError as exc:
            raise KVTransferError(f"KV of {request_id!r} starts at token {start}, "
                                  f"but {exc}") from exc


async def kv_arrival(request: DecodeRequest, assembly: KVAssembly,
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
        self.peer = "?"  # the sending node (services/worker/kv_metrics.py: its link)
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
