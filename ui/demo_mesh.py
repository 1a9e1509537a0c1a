"""A synthetic PrfaaS mesh: a seeded, plausible stream of telemetry events, without the mesh.

Two clusters (PrfaaS prefill workers; PD prefill and decode workers) joined by one link.
Requests arrive as a Poisson stream with the paper's input lengths, some continuing an earlier
conversation (so part of their prefix is cached); they are routed on their incremental length,
prefill, ship their KV in layer groups that share the link's bandwidth, and decode. It is a
discrete-event simulation on its own time: `advance_to(t)` returns the events up to t in order,
so a seed always gives the same log, and the demo source advances it with the wall clock.
It feeds the page before the real mesh exists, the recorded sample log and the load test.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Any, ClassVar

import msgspec

from services.contract.events import (
    AnyEvent,
    CacheActivity,
    KVFlow,
    RequestDone,
    RequestPhase,
    RoutingDecision,
    ThresholdChanged,
)
from services.contract.types import WorkerRole as Role
from ui.demo_link import SyntheticLink, SyntheticLinkStatistics
from ui.demo_model import (
    INTRA_CLUSTER_BPS,
    History,
    Request,
    SyntheticConfig,
    Worker,
    blocks,
    kv_bytes,
    prefill_seconds,
    prompt,
    route,
    tune,
)
from ui.demo_workers import WorkerPool

LINK_RETRY_S = 0.25  # a layer group waiting on a dead link looks again this often
LOSS_STALL_S = 0.2  # a retransmission timeout after a loss
THRESHOLD_POLICIES = ("prfaas", "length")


class SyntheticStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset({"requests"})

    now: float
    requests: int
    running: bool
    rate: float
    pending: int  # scheduled actions
    link: SyntheticLinkStatistics


class SyntheticMesh:
    """The simulation; `advance_to` runs it, the control methods change it at `now`."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.now = config.start_ts
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = count()
        self._out: list[AnyEvent] = []
        self.policy = config.policy
        self.threshold = config.threshold
        self.threshold_override = False
        self.rate = config.rate
        self.running = False
        self._generation = 0  # of the arrival chain, so stop + start never runs two chains
        self.link = SyntheticLink(config.link, config.bandwidth_bps, config.delay_ms, self.now)
        self._history: History = deque(maxlen=64)
        self.pool = WorkerPool(config)
        self._requests = 0
        self._at(self.now, self._sample)
        if config.auto_threshold:
            self._at(self.now + config.tune_interval_s, self._tune)
        if config.running:
            self.start(config.rate)

    # The event loop.

    def _at(self, time: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (time, next(self._order), action, args))

    def advance_to(self, time: float) -> list[AnyEvent]:
        """Runs everything due up to `time`; returns the events, in time order."""
        while self._heap and self._heap[0][0] <= time:
            when, _, action, args = heapq.heappop(self._heap)
            self.now = max(self.now, when)
            action(*args)
        self.now = max(self.now, time)
        out, self._out = self._out, []
        return out

    def _emit(self, event: AnyEvent) -> None:
        self._out.append(event)

    # Workload.

    def start(self, rate: float) -> None:
        self.rate, self.running = rate, True
        self._generation += 1
        self._at(self.now + self.rng.expovariate(rate), self._arrive, self._generation)

    def stop(self) -> None:
        self.running = False
        self._generation += 1

    def _arrive(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._admit()
        self._at(self.now + self.rng.expovariate(self.rate), self._arrive, generation)

    def _admit(self) -> None:
        self._requests += 1
        rid = f"req-{self._requests:05d}"
        total, cached_prfaas, cached_pd, holder = prompt(self.rng, self.config, self._history)
        scarce = self.link.load > 0.6 or not self.link.up
        r = route(self.policy, self.threshold, total, cached_prfaas, cached_pd, scarce)
        wanted = "prfaas" if r.remote else "pd"
        prefill = self.pool.pick(wanted, "prefill") or self.pool.pick(None, "prefill")
        decode = self.pool.pick("pd", "decode", prefer=holder)
        if prefill is None or decode is None:
            self._fail(rid, total, "no prefill or decode worker is available")
            return
        remote = prefill.cluster != decode.cluster
        held_pd = cached_pd if decode is holder else 0
        computed = total - (cached_prfaas if prefill.cluster == "prfaas" else held_pd)
        self._emit(
            RoutingDecision(
                ts=self.now,
                source="router",
                request_id=rid,
                policy=self.policy,
                total_len=total,
                cached_prfaas=cached_prfaas,
                cached_pd=cached_pd,
                incremental_len=r.incremental,
                threshold=r.threshold,
                link_utilisation=self.link.load,
                queue_prfaas=self.pool.queue_depth("prfaas"),
                queue_pd=self.pool.queue_depth("pd"),
                cluster=prefill.cluster,
                prefill_worker=prefill.name,
                decode_worker=decode.name,
                bandwidth_scarce=scarce,
                reason=r.reason,
            )
        )
        output = self.rng.randint(self.config.output_min, self.config.output_max)
        request = Request(
            rid, self.now, total, computed, total - held_pd, remote, prefill, decode, output
        )
        self._phase(request, "queued", prefill)
        prefill.queue.append(request)
        self._next_prefill(prefill)

    def _fail(self, rid: str, total: int, why: str) -> None:
        self._emit(
            RequestPhase(
                ts=self.now, source="router", request_id=rid, phase="failed", worker="", detail=why
            )
        )
        self._emit(
            RequestDone(
                ts=self.now,
                source="router",
                request_id=rid,
                cluster="",
                ttft_s=0.0,
                tpot_s=0.0,
                e2e_s=0.0,
                prompt_tokens=total,
                output_tokens=0,
                cached_tokens=0,
                ok=False,
                error=why,
            )
        )

    def _phase(self, request: Request, phase: Any, worker: Worker, detail: str = "") -> None:
        self._emit(
            RequestPhase(
                ts=self.now,
                source=worker.name,
                request_id=request.request_id,
                phase=phase,
                worker=worker.name,
                detail=detail,
            )
        )

    # Prefill, transfer, decode.

    def _next_prefill(self, worker: Worker) -> None:
        if worker.running or not worker.queue:
            return
        request = worker.queue.popleft()
        worker.running = 1
        self._phase(request, "prefill", worker, f"{request.computed} new tokens")
        seconds = prefill_seconds(request.computed) / self.config.speedup
        if worker.cluster != "prfaas":
            seconds *= self.config.pd_slowdown
        self._at(self.now + seconds, self._prefilled, request)

    def _prefilled(self, request: Request) -> None:
        worker = request.prefill
        worker.running = 0
        stored = blocks(request.computed)
        worker.cached_blocks += stored
        self._emit(
            CacheActivity(
                ts=self.now,
                source="cachedir",
                worker=worker.name,
                cluster=worker.cluster,
                kind="stored",
                blocks=stored,
                total_blocks=worker.cached_blocks,
            )
        )
        request.bytes_total = kv_bytes(request.sent)
        self._phase(request, "transfer", request.decode)
        self._flow(request, "start")
        if request.remote:
            self.link.add(request, self.now)
        self._send_chunk(request, first=True)
        self._next_prefill(worker)
        self._finish_conversion(worker)

    def _flow(self, request: Request, phase: Any) -> None:
        c = self.config
        self._emit(
            KVFlow(
                ts=self.now,
                source=request.prefill.name,
                request_id=request.request_id,
                src=request.prefill.name,
                dst=request.decode.name,
                via_link=c.link if request.remote else None,
                phase=phase,
                layers_done=c.layers * request.chunks_done // c.chunks,
                layers_total=c.layers,
                bytes_done=request.bytes_done,
                bytes_total=request.bytes_total,
                incremental=request.sent < request.total,
                tokens_sent=request.sent,
            )
        )

    def _send_chunk(self, request: Request, first: bool = False) -> None:
        chunk = request.bytes_total / self.config.chunks
        if not request.remote:
            self._at(self.now + chunk * 8 / INTRA_CLUSTER_BPS, self._chunk_sent, request)
            return
        if not self.link.up:
            self.link.stalls += 1
            self._at(self.now + LINK_RETRY_S, self._send_chunk, request, first)
            return
        delay = self.link.params["delay_ms"] / 1e3 if first else 0.0
        seconds = chunk * 8 / self.link.share_bps() + delay
        if self.rng.random() < min(1.0, self.link.params["loss"] * 50):
            self.link.stalls += 1
            seconds += LOSS_STALL_S
        self._at(self.now + seconds, self._chunk_sent, request)

    def _chunk_sent(self, request: Request) -> None:
        chunk = request.bytes_total // self.config.chunks
        request.chunks_done += 1
        last = request.chunks_done == self.config.chunks
        sent = request.bytes_total - request.bytes_done if last else chunk
        request.bytes_done += sent
        if not last:
            self._flow(request, "progress")
            self._send_chunk(request)
            return
        self._flow(request, "done")
        if request.remote:
            self.link.remove(request, self.now)
        decode = request.decode
        decode.queue.append(request)
        self._next_decode(decode)

    def _next_decode(self, worker: Worker) -> None:
        while worker.queue and worker.running < self.config.max_decode_batch:
            request = worker.queue.popleft()
            worker.running += 1
            self._phase(request, "decode", worker)
            self._at(self.now + request.output * self.config.tpot_s, self._decoded, request)

    def _decoded(self, request: Request) -> None:
        worker = request.decode
        worker.running -= 1
        tpot = self.config.tpot_s
        e2e = self.now - request.arrival
        ttft = e2e - (request.output - 1) * tpot
        self._phase(request, "finished", worker)
        self._emit(
            RequestDone(
                ts=self.now,
                source="router",
                request_id=request.request_id,
                cluster=request.prefill.cluster,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                prompt_tokens=request.total,
                output_tokens=request.output,
                cached_tokens=request.total - request.computed,
                ok=True,
            )
        )
        self._history.append((request.total, request.prefill.cluster == "prfaas", worker))
        self._next_decode(worker)
        self._finish_conversion(worker)

    # Workers and their roles.

    @property
    def workers(self) -> dict[str, Worker]:
        return self.pool.workers

    def set_role(self, worker: Worker, role: Role | None, reason: str) -> None:
        """Drains `worker`; once idle it takes `role` (None: it stays drained)."""
        self._out.extend(self.pool.set_role(worker, role, reason, self.now))

    def _finish_conversion(self, worker: Worker) -> None:
        self._out.extend(self.pool.finish_conversion(worker, self.now))

    # Periodic samples and the short-term loop.

    def _sample(self) -> None:
        self.sample_now()
        self._at(self.now + self.config.stats_interval_s, self._sample)

    def set_link(self, changes: dict[str, Any]) -> None:
        """Applies link parameters (the link API's keys) now, and reports the link at once."""
        self.link.set(changes, self.now)
        self.sample_now(measure=False)

    def sample_now(self, measure: bool = True) -> None:
        """Emits a status of every worker and of the link; `measure` starts a new interval.

        A control sends an unmeasured sample at once, so the page sees its effect without
        waiting for the next period; it repeats the last measured throughput.
        """
        self._out.extend(self.pool.statuses(self.now))
        self._emit(self.link.sample(self.now, measure))

    def _tune(self) -> None:
        self._at(self.now + self.config.tune_interval_s, self._tune)
        if self.policy not in THRESHOLD_POLICIES or self.threshold_override:
            return
        new, reason = tune(
            self.threshold,
            self.link.load,
            self.pool.queue_depth("prfaas"),
            self.pool.queue_depth("pd"),
        )
        if new != self.threshold:
            self.set_threshold(new, reason)

    def set_policy(self, policy: str, reason: str) -> None:
        old = self.threshold if self.policy in THRESHOLD_POLICIES else None
        self.policy = policy
        new = self.threshold if policy in THRESHOLD_POLICIES else None
        self._emit(
            ThresholdChanged(
                ts=self.now, source="router", policy=policy, old=old, new=new, reason=reason
            )
        )

    def set_threshold(self, new: float, reason: str) -> None:
        old, self.threshold = self.threshold, new
        self._emit(
            ThresholdChanged(
                ts=self.now, source="router", policy=self.policy, old=old, new=new, reason=reason
            )
        )

    def statistics(self) -> SyntheticStatistics:
        return SyntheticStatistics(
            self.now,
            self._requests,
            self.running,
            self.rate,
            len(self._heap),
            self.link.statistics(),
        )

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        assert all(request.remote for request in self.link.flows)
        assert len({id(request) for request in self.link.flows}) == len(self.link.flows)
        assert all(entry[0] >= self.now for entry in self._heap)
