"""The decode worker's incoming KV: one `KVAssembly` per request, from its first upload lane
or its decode stream, whichever comes first, until the decode stream ends.

Nothing is held for nobody:
- a decode stream that ends (finished, failed or aborted) releases its request at once: the
  pieces go, and lanes of that request still uploading, or arriving later, are refused
  (`StreamAborted`, so the prefill worker stops sending) for `orphan_timeout` seconds;
- KV no decode stream claimed within `orphan_timeout` is dropped by `sweep_every`, a timer
  task, not by the next arrival;
- a lane that fails drops its request's pieces at once (the stream that waits learns why).

`KVTransferMetrics`: the KV transfers a worker received, as Prometheus histograms:
`prfaas_kv_transfer_seconds` and `prfaas_kv_transfer_bytes`, labelled by the receiving service,
the link the KV crossed ("local" inside a cluster) and its kind: "full" (the decode worker held
none of the prompt), "incremental" (it held a prefix, so only the rest came), "prefix" (a cached
prefix pulled to a prefill worker, services/worker/prefix_pull.py).

Seconds run from the first piece's arrival to the end of the import, both on the receiver's
clock: the sender's clock is another host's on a mesh across hosts, so the first piece's
one-way delay (the link's propagation delay, a few ms on the default link) is left out. Bytes
are the pieces' payload (the modeled size in the simulation). The receiver observes: it alone
knows when the KV was imported, and the decode worker and a pulling prefill worker receive
through the same `KVAssembly`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import ClassVar

import anyio
import msgspec
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh.errors import StreamAborted
from mesh.histogram import Histogram
from services.contract.errors import KVTransferError, RequestError
from services.contract.messages import KVAccepted, KVChunk, KVClose, KVOpen
from services.contract.sampling import TokenLogprob
from services.service import BYTES_BUCKETS, SECONDS_BUCKETS

log = logging.getLogger(__name__)

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
        self._changed = anyio.Event()

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
        self.progress_at = anyio.current_time()

    def add(self, chunk: KVChunk) -> None:
        key = (chunk.layer, chunk.start)
        if key in self.pieces:
            raise KVTransferError(f"piece (layer {chunk.layer}, start {chunk.start}) of "
                                  f"{self.request_id!r} arrived twice")
        self.pieces[key] = _owned(chunk.data)
        self.nbytes += len(chunk.data)
        self.received_bytes += chunk.size
        if self.first_piece_at is None:
            self.first_piece_at = anyio.current_time()
        self.progress_at = anyio.current_time()

    def close_lane(self, lane: int) -> None:
        self._closed.add(lane)
        self.progress_at = anyio.current_time()
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

    async def wait(self) -> None:
        while not self.finished:
            await self._changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


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
            async for item in items:
                count, nbytes = count + 1, nbytes + self._take(assembly, opening, item)
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
        cutoff = anyio.current_time() - self.orphan_timeout
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
        self._gone[assembly.request_id] = anyio.current_time()

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
            assembly = KVAssembly(request_id, anyio.current_time())
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
        self.seconds.labels(*labels).observe(anyio.current_time() - started)
        self.bytes.labels(*labels).observe(assembly.received_bytes)

    def collect(self) -> Iterator[Metric]:
        yield from self.seconds.collect()
        yield from self.bytes.collect()
