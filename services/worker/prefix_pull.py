"""Moving a cached prefix between workers: the abundant prefix rule's cache transfer.

Paper section 3.3: when bandwidth is abundant the best cache anywhere counts, and "when the
cluster with the longer cache differs from the compute cluster, a cross-cluster cache transfer
is performed". Here that is one KV upload over the existing stream protocol
(services/worker/kv_out.py), from the worker that holds the prefix to the prefill worker that
will compute the rest:

1. the router names the holder and the prefix length in `PrefillRequest.pull`;
2. the prefill worker (`PrefixTransfer.pull`) claims an assembly in its own `KVInbox` and
   calls the holder with `PushPrefix`, saying how much of the prefix's KV it already holds;
3. the holder (`PrefixTransfer.push`) resumes the prefix from its store (the KV before the
   prefix's end and the state snapshot at it), has its engine export each layer's piece -
   full-attention KV from the target's held length on, every fixed-size state at the
   prefix's end (the simulation's modeled engine: the pieces' sizes) - and streams
   them over its lanes as `KVOpen(purpose="prefix")`, `KVChunk`s and, on lane 0, `KVClose`;
   across clusters the lanes go through the link's proxy like any KV, so the link shapes
   and counts them;
4. once every lane is accepted the call returns; the target imports the pieces on top of
   what it held and keeps the result in its prefix store (reported to the cache directory),
   so the prefill that follows resumes from it.

A pull that fails (the holder evicted it, the link broke) is logged and counted; the prefill
then computes from the worker's own cache, and its `PrefillDone.reused_tokens` says so.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar

import anyio
import msgspec

from mesh.errors import MeshError
from mesh.node import Node
from services.contract.errors import DataPathError, KVTransferError, RequestError
from services.contract.messages import (
    KVAccepted,
    KVChunk,
    KVClose,
    KVOpen,
    PrefillRequest,
    PrefixPull,
    PrefixPushed,
    PushPrefix,
)
from services.model.config import ModelConfig
from services.worker.engine import Engine, PieceSpec
from services.worker.kv_in import KVInbox
from services.worker.kv_metrics import KVTransferMetrics
from services.worker.kv_out import stream_plan
from services.worker.prefix_store import PrefixStore, PrefixStoreError, StoreChange, prompt_hashes
from services.worker.request_checks import check_held_tokens, check_lanes

log = logging.getLogger(__name__)

NO_TOKEN = -1  # KVClose.first_token of a prefix push: nothing was sampled


class PrefixPullStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset(
        {"pulls", "pull_failures", "pulled_tokens", "pulled_bytes", "pushes", "pushed_bytes"})

    pulls: int
    pull_failures: int
    pulled_tokens: int
    pulled_bytes: int
    pushes: int
    pushed_bytes: int


def prefix_plan(cfg: ModelConfig, has: int, end: int) -> list[PieceSpec]:
    """The pieces of a prefix [0, end) for a worker holding [0, has): as one chunk's plan."""
    return stream_plan(cfg, [(has, end)], has)[0]


class PrefixTransfer:
    """Both sides of a prefix transfer for one worker: pushing what it holds, pulling what it
    lacks (module docstring). `lanes[0]` is the worker's own node."""

    def __init__(self, name: str, engine: Engine, store: PrefixStore, lanes: Sequence[Node],
                 *, report: Callable[[StoreChange], None] | None = None,
                 timeout: float = 120.0, kv_metrics: KVTransferMetrics | None = None) -> None:
        self.name, self.engine, self.store = name, engine, store
        self.kv_metrics = kv_metrics or KVTransferMetrics(name)
        self._lanes = list(lanes)
        self._report = report
        self.timeout = timeout
        cfg = engine.cfg
        self.inbox = KVInbox(name, (cfg.family, cfg.config_hash(), engine.dtype_name), timeout)
        self._counts = dict.fromkeys(PrefixPullStatistics.counters, 0)

    # The target's side -------------------------------------------------------------------

    async def pull(self, request: PrefillRequest, chain: Sequence[int]) -> int:
        """Fetches `request.pull` into the store unless the store has it; tokens moved (0
        when nothing moved, also when the pull failed: the prefill computes more then).
        `chain`: the prompt's block hashes (`prompt_hashes`), of which the prefix's lead."""
        pull = request.pull
        if pull is None:
            return 0
        block = self.engine.cfg.block_size
        _check_pull(pull, len(request.prompt), block)
        hashes = list(chain[: pull.tokens // block])
        if self.store.match(hashes).resumable >= len(hashes):
            return 0
        try:
            return await self._pull(request.request_id, request.prompt[:pull.tokens], hashes,
                                    pull)
        except (MeshError, DataPathError, PrefixStoreError) as exc:
            self._counts["pull_failures"] += 1
            log.warning("%s: pulling %d cached tokens of %r from %s failed, computing them: "
                        "%s", self.name, pull.tokens, request.request_id, pull.holder, exc)
            return 0

    async def _pull(self, request_id: str, prefix: list[int], hashes: list[int],
                    pull: PrefixPull) -> int:
        block: int = self.engine.cfg.block_size
        has = self.store.match(hashes).held * block
        key = f"{request_id}/prefix"
        assembly = self.inbox.claim(key)
        try:
            push = PushPrefix(request_id=key, prompt=prefix, target=self.name,
                              target_has_tokens=has, connections=pull.connections)
            done = await self._lanes[0].call(pull.holder, push, PrefixPushed,
                                             timeout=self.timeout)
            with anyio.fail_after(self.timeout):
                await assembly.wait()
            if assembly.failure is not None:
                raise assembly.failure
            # Whole (`KVAssembly.ready`): every lane opened.
            assert assembly.opening is not None
            base = self.store.kv_base(hashes, has // block) if has else None
            cache = await self.engine.import_kv(assembly.opening, base, assembly.pieces)
            self.kv_metrics.imported(assembly)
        finally:
            self.inbox.release(key)
        self._keep(hashes, cache)
        self._counts["pulls"] += 1
        self._counts["pulled_tokens"] += pull.tokens - has
        self._counts["pulled_bytes"] += done.kv_bytes
        return pull.tokens - has

    def _keep(self, hashes: list[int], cache: Any) -> None:
        change = self.store.store(hashes, cache)
        if self._report is not None:
            self._report(change)

    async def receive(self, opening: KVOpen, items: AsyncIterator[msgspec.Struct],
                      peer: str) -> KVAccepted:
        """One lane of a prefix pushed to this worker (the KVOpen handler's prefix branch)."""
        if not self.inbox.expects(opening.request_id):
            raise KVTransferError(f"{self.name} did not ask for the prefix {opening.request_id!r}")
        return await self.inbox.receive(opening, items, peer)

    # The holder's side -------------------------------------------------------------------

    async def push(self, request: PushPrefix) -> PrefixPushed:
        """Streams the cached prefix `request.prompt` to `request.target` (module docstring,
        step 3); RequestError when this worker cannot resume exactly that prefix."""
        cfg, end = self.engine.cfg, len(request.prompt)
        has = request.target_has_tokens
        _check_push(request, cfg.block_size, len(self._lanes))
        hashes = prompt_hashes(request.prompt, cfg.block_size)
        cache = self.store.resume(hashes, len(hashes))
        if cache is None or cache.length != end:
            raise RequestError(f"{self.name} cannot resume the {end}-token prefix of "
                               f"{request.request_id!r} (holds {cache.length if cache else 0})")
        pieces = await self.engine.export_kv(request.request_id, cache,
                                             prefix_plan(cfg, has, end))
        lanes = request.connections
        sent = [0, 0]
        async with anyio.create_task_group() as group:
            for lane in range(lanes):
                group.start_soon(self._send_lane, request, cache, pieces[lane::lanes], lane,
                                 sent)
        self._counts["pushes"] += 1
        self._counts["pushed_bytes"] += sent[1]
        return PrefixPushed(request_id=request.request_id, worker=self.name, tokens=end - has,
                            kv_bytes=sent[1], pieces=sent[0], lanes=lanes)

    async def _send_lane(self, request: PushPrefix, cache: Any, pieces: list[KVChunk],
                         lane: int, sent: list[int]) -> None:
        cfg = self.engine.cfg
        opening = KVOpen(
            request_id=request.request_id, family=cfg.family, config_hash=cfg.config_hash(),
            dtype=cache.dtype_name, start=request.target_has_tokens, end=len(request.prompt),
            pieces=len(pieces), lane=lane, lanes=request.connections, purpose="prefix")
        async with self._lanes[lane].stream_to(request.target, opening,
                                               timeout=self.timeout) as sink:
            for chunk in pieces:
                await sink.send(chunk)
                sent[0], sent[1] = sent[0] + 1, sent[1] + chunk.size
            if lane == 0:
                await sink.send(KVClose(request_id=request.request_id, first_token=NO_TOKEN))
        if not isinstance(sink.result, KVAccepted):
            raise KVTransferError(f"{request.target} answered lane {lane} of the prefix "
                                  f"{request.request_id!r} with {sink.result!r}")

    def statistics(self) -> PrefixPullStatistics:
        return PrefixPullStatistics(**self._counts)


def _check_pull(pull: PrefixPull, length: int, block: int) -> None:
    if pull.tokens % block or not 0 < pull.tokens < length:
        raise RequestError(f"pull.tokens must be a multiple of {block} in (0, {length}), got "
                           f"{pull.tokens}")
    if pull.connections < 1:
        raise RequestError(f"pull.connections must be >= 1, got {pull.connections}")


def _check_push(request: PushPrefix, block: int, max_lanes: int) -> None:
    end = len(request.prompt)
    if end < 1 or end % block:
        raise RequestError(f"a pushed prefix must hold a positive multiple of {block} tokens, "
                           f"got {end}")
    check_held_tokens("target_has_tokens", request.target_has_tokens, block, end)
    check_lanes(request.connections, max_lanes)
