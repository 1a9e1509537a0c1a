"""What the dashboard knows now: folded from the event stream, bounded, served as a snapshot.

A page that connects mid-run asks for `DashboardState.snapshot()` and then applies the live
events that follow it; everything held here has a fixed bound (DashboardConfig), so a long run
costs the dashboard no more memory than a short one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar

import msgspec

from services.contract.events import (
    AnyEvent,
    KVFlow,
    LinkStats,
    RequestDone,
    RequestMigrated,
    RequestPhase,
    RoleChanged,
    RoutingDecision,
    ThresholdChanged,
    WorkerStatus,
    base_request_id,
)
from ui.config import DashboardConfig
from ui.series import SeriesAggregator, SeriesPoint

Mode = Literal["live", "replay"]
PageMode = Literal["live", "simulated", "replay"]  # the page's badge (DashboardConfig.live_mode)
K = TypeVar("K")
# A request passes through about six phases; more means a misbehaving source, not more detail.
MAX_PHASES = 32
V = TypeVar("V")


class StateStatistics(msgspec.Struct, frozen=True):
    """Sizes of every bounded collection, and events folded so far."""

    counters: ClassVar[frozenset[str]] = frozenset({"events"})

    events: int
    decisions: int
    workers: int
    links: int
    flows: int
    requests: int
    points: int


class PageConfig(msgspec.Struct, frozen=True):
    """The part of the configuration the page needs."""

    title: str
    prfaas_clusters: tuple[str, ...]
    table_rows: int
    policies: tuple[str, ...] = ()  # registered policy names, from the source side
    token_scale: float = 1.0  # served tokens per paper token


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a page needs to draw the current state; `seq` is the last event it includes."""

    seq: int
    mode: PageMode
    config: PageConfig
    policy: str | None
    threshold: float | None
    decisions: list[RoutingDecision]  # oldest first
    workers: list[WorkerStatus]
    links: list[LinkStats]
    flows: list[KVFlow]  # in flight
    series: list[SeriesPoint]


class RequestView(msgspec.Struct, frozen=True):
    """One request as far as the dashboard saw it: the waterfall's data."""

    request_id: str
    decision: RoutingDecision | None
    phases: list[RequestPhase]
    flow: KVFlow | None  # the latest state of its KV transfer
    done: RequestDone | None
    migrations: list[RequestMigrated] = []  # where its data path broke and it went on


@dataclass
class _Request:
    decision: RoutingDecision | None = None
    phases: list[RequestPhase] = field(default_factory=list)
    flow: KVFlow | None = None
    done: RequestDone | None = None
    migrations: list[RequestMigrated] = field(default_factory=list)


def _bounded_put(table: OrderedDict[K, V], key: K, value: V, bound: int) -> None:
    table[key] = value
    while len(table) > bound:
        table.popitem(last=False)


class DashboardState:
    """Folds telemetry events into bounded tables and the chart series."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.series = SeriesAggregator(config)
        self.decisions: deque[RoutingDecision] = deque(maxlen=config.max_decisions)
        self.workers: OrderedDict[str, WorkerStatus] = OrderedDict()
        self.links: dict[str, LinkStats] = {}
        self.flows: OrderedDict[str, KVFlow] = OrderedDict()
        self.requests: OrderedDict[str, _Request] = OrderedDict()
        self.policy: str | None = None
        self.threshold: float | None = None
        self.events = 0

    def apply(self, event: AnyEvent) -> list[SeriesPoint]:
        """Folds one event in; returns the chart points it closed."""
        self.events += 1
        points = self.series.observe(event)
        if isinstance(event, RoutingDecision):
            self._decision(event)
        elif isinstance(event, WorkerStatus):
            _bounded_put(self.workers, event.worker, event, self.config.max_workers)
        elif isinstance(event, LinkStats):
            self.links[event.link] = event
        elif isinstance(event, KVFlow):
            self._flow(event)
        elif isinstance(event, RequestPhase):
            # A migrated request's attempts are one timeline (the workers see attempt ids).
            phases = self._request(base_request_id(event.request_id)).phases
            if len(phases) < MAX_PHASES:
                phases.append(event)
        elif isinstance(event, RequestDone):
            self._request(event.request_id).done = event
        elif isinstance(event, RequestMigrated):
            migrations = self._request(event.request_id).migrations
            if len(migrations) < MAX_PHASES:
                migrations.append(event)
        elif isinstance(event, ThresholdChanged):
            self.policy, self.threshold = event.policy, event.new
        elif isinstance(event, RoleChanged):
            self._role(event)
        return points

    def _decision(self, event: RoutingDecision) -> None:
        self.decisions.append(event)
        self.policy, self.threshold = event.policy, event.threshold
        self._request(event.request_id).decision = event

    def _flow(self, event: KVFlow) -> None:
        self._request(base_request_id(event.request_id)).flow = event
        if event.phase in ("done", "failed"):
            self.flows.pop(event.request_id, None)
        else:
            _bounded_put(self.flows, event.request_id, event, self.config.max_flows)

    def _role(self, event: RoleChanged) -> None:
        status = self.workers.get(event.worker)
        if status is not None:
            self.workers[event.worker] = msgspec.structs.replace(status, role=event.new)

    def _request(self, request_id: str) -> _Request:
        record = self.requests.get(request_id)
        if record is None:
            record = _Request()
            _bounded_put(self.requests, request_id, record, self.config.max_timelines)
        return record

    def request(self, request_id: str) -> RequestView | None:
        """What is known of one request, or None when it was never seen or is forgotten."""
        record = self.requests.get(request_id)
        if record is None:
            return None
        phases = list(record.phases)
        return RequestView(request_id, record.decision, phases, record.flow, record.done,
                           list(record.migrations))

    def snapshot(self, seq: int, mode: PageMode) -> Snapshot:
        config = self.config
        return Snapshot(
            seq=seq,
            mode=mode,
            config=PageConfig(config.title, config.prfaas_clusters, config.table_rows,
                              config.policies, config.token_scale),
            policy=self.policy,
            threshold=self.threshold,
            decisions=list(self.decisions),
            workers=list(self.workers.values()),
            links=list(self.links.values()),
            flows=list(self.flows.values()),
            series=list(self.series.points),
        )

    def statistics(self) -> StateStatistics:
        return StateStatistics(
            events=self.events,
            decisions=len(self.decisions),
            workers=len(self.workers),
            links=len(self.links),
            flows=len(self.flows),
            requests=len(self.requests),
            points=len(self.series.points),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError when a bound or an invariant does not hold."""
        config = self.config
        assert len(self.flows) <= config.max_flows, len(self.flows)
        assert len(self.requests) <= config.max_timelines, len(self.requests)
        assert len(self.workers) <= config.max_workers, len(self.workers)
        assert all(flow.phase in ("start", "progress") for flow in self.flows.values())
        assert all(key == flow.request_id for key, flow in self.flows.items())
        for key, record in self.requests.items():
            assert all(base_request_id(phase.request_id) == key for phase in record.phases), key
