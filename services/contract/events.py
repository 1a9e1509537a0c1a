"""The event schema: what the services tell the dashboard (and the recorded event logs).

Every service publishes these typed events on its mesh event bus; the dashboard subscribes to
all of them and a run can be recorded as JSON lines (one event a line) and replayed later.
This module is the contract between `services` and `ui`: the dashboard sees the services only
through it and their HTTP endpoints. Times are seconds on the publishing service's clock
(`ts`, wall or virtual); sizes are bytes; lengths are tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal, get_args

import msgspec

from services.contract.types import Phase, WorkerRole


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    """Base of every event: where and when it happened."""

    ts: float
    source: str


class RoutingDecision(Event, frozen=True, tag="decision"):
    """One request placed by the router, with every input of the decision and why."""

    request_id: str
    policy: str
    total_len: int
    cached_prfaas: int  # longest cached prefix (tokens) usable in the PrfaaS cluster
    cached_pd: int  # ... and in the PD cluster
    incremental_len: int  # total_len - the prefix the policy counted
    # t at decision time; None when the policy has no threshold (JSON has no infinity)
    threshold: float | None
    link_utilisation: float  # 0..1, egress of the PrfaaS cluster's link
    queue_prfaas: int  # queued prefill jobs in the PrfaaS cluster
    queue_pd: int  # ... and in the PD cluster
    cluster: str  # where prefill runs
    prefill_worker: str
    decode_worker: str
    bandwidth_scarce: bool
    reason: str  # one line a student can read
    # The request's OpenTelemetry trace (32 hex digits; "" when tracing is off), to find it
    # in Jaeger or Tempo (docs/observability.md, "Traces").
    trace_id: str = ""


class KVFlow(Event, frozen=True, tag="kvflow"):
    """A KV transfer from a prefill worker to a decode worker: started, progressing, done."""

    request_id: str
    src: str
    dst: str
    via_link: str | None  # the link name when it crosses clusters, None when direct
    phase: Literal["start", "progress", "done", "failed"]
    layers_done: int
    layers_total: int
    bytes_done: int
    bytes_total: int
    incremental: bool  # True when the decode side already held a prefix
    tokens_sent: int  # new tokens whose KV this flow carries


class LinkStats(Event, frozen=True, tag="link"):
    """A periodic sample of one emulated link."""

    link: str
    bandwidth_bps: float  # the configured rate (0 = unshaped)
    delay_s: float
    jitter_s: float
    loss: float
    up: bool
    throughput_bps: float  # measured over the last interval, PrfaaS -> PD direction
    utilisation: float  # throughput / bandwidth, 0..1
    queued_bytes: int
    stalls: int  # retransmission stalls so far
    a: str = ""  # the cluster the link carries KV from (the PrfaaS side)
    b: str = ""  # ... and the cluster it delivers to


class WorkerStatus(Event, frozen=True, tag="worker"):
    """A periodic sample of one worker."""

    worker: str
    cluster: str
    role: WorkerRole
    queue_depth: int
    running: int  # requests in prefill, or in the decode batch
    busy: bool
    cached_blocks: int
    model: str = ""  # what it serves: family, size and dtype ("kimi-linear default bfloat16")


class RequestPhase(Event, frozen=True, tag="phase"):
    """A request entered a phase; the dashboard's waterfall is built from these."""

    request_id: str
    phase: Phase
    worker: str
    detail: str = ""


class RequestDone(Event, frozen=True, tag="done"):
    """A request finished at the router, with its latencies (docs/architecture.md section 8)."""

    request_id: str
    cluster: str
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ok: bool
    error: str = ""
    trace_id: str = ""  # as in RoutingDecision


MigrationReason = Literal["decode_lost", "prefill_lost", "kv_stalled", "kv_cut"]
MIGRATION_REASONS: tuple[MigrationReason, ...] = get_args(MigrationReason)


class RequestMigrated(Event, frozen=True, tag="migrated"):
    """A request's data path broke and the router continued it elsewhere (its timeline shows
    the break): decode_lost (the decode worker or its stream went), prefill_lost (the prefill
    worker went before the first token), kv_stalled (its KV made no progress on the link for
    the bound) or kv_cut (its KV stream broke on the way). `attempt` counts from 1; the
    workers see the attempt's own id (`attempt_id`)."""

    request_id: str
    attempt: int
    reason: MigrationReason
    failed_worker: str  # the worker whose side broke
    prefill_worker: str  # where the attempt goes on
    decode_worker: str
    cluster: str  # the cluster of its new prefill
    tokens_kept: int  # output tokens already streamed, re-sent with the prompt
    detail: str = ""


class ThresholdChanged(Event, frozen=True, tag="threshold"):
    """The router's threshold t moved (short-term loop, planner re-solve, or an override)."""

    policy: str
    old: float | None  # None: no threshold (JSON has no infinity)
    new: float | None
    reason: str


class RoleChanged(Event, frozen=True, tag="role"):
    """A PD worker was converted between prefill and decode (long-term loop or by hand)."""

    worker: str
    old: WorkerRole
    new: WorkerRole
    reason: str


class CacheActivity(Event, frozen=True, tag="cache"):
    """Blocks stored on or evicted from a worker, as the cache directory saw it."""

    worker: str
    cluster: str
    kind: Literal["stored", "evicted"]
    blocks: int
    total_blocks: int


AnyEvent = (
    RoutingDecision
    | KVFlow
    | LinkStats
    | WorkerStatus
    | RequestPhase
    | RequestDone
    | RequestMigrated
    | ThresholdChanged
    | RoleChanged
    | CacheActivity
)

EVENT_TYPES: tuple[type[Event], ...] = (
    RoutingDecision,
    KVFlow,
    LinkStats,
    WorkerStatus,
    RequestPhase,
    RequestDone,
    RequestMigrated,
    ThresholdChanged,
    RoleChanged,
    CacheActivity,
)

_json_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)
_json_encoder = msgspec.json.Encoder()


# The workers know a migrated request by its attempt's id: the router's id and this mark.
ATTEMPT_MARK = ".m"


def attempt_id(request_id: str, attempt: int) -> str:
    """The id the workers see for `attempt` of a request (0: the router's id itself)."""
    return request_id if attempt == 0 else f"{request_id}{ATTEMPT_MARK}{attempt}"


def base_request_id(request_id: str) -> str:
    """The router's id of a request from any of its attempts' ids (`attempt_id`)."""
    base, mark, attempt = request_id.rpartition(ATTEMPT_MARK)
    return base if mark and attempt.isdigit() else request_id


def encode_json(event: Event) -> bytes:
    """One event as a JSON object (what the dashboard receives and event logs hold)."""
    return _json_encoder.encode(event)


def decode_json(data: bytes | str) -> AnyEvent:
    """An event from its JSON form; raises msgspec.ValidationError naming the bad field."""
    return _json_decoder.decode(data)


def write_event_log(path: Path, events: Iterable[Event]) -> int:
    """Writes `events` as an event log: JSON lines, one event a line (what the dashboard
    replays); returns how many."""
    count = 0
    with path.open("wb") as file:
        for event in events:
            file.write(encode_json(event) + b"\n")
            count += 1
    return count
