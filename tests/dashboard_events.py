"""Dashboard events with plausible values, one builder per event type the tests make often:
for the tests that feed the dashboard and those that round-trip the events."""

from __future__ import annotations

from typing import Any, Literal

from services.contract import events as t
from services.contract.types import WorkerRole


def decision(ts: float, rid: str = "r1", cluster: str = "prfaas", **kw: Any) -> t.RoutingDecision:
    fields: dict[str, Any] = dict(
        ts=ts,
        source="router",
        request_id=rid,
        policy="prfaas",
        total_len=30000,
        cached_prfaas=0,
        cached_pd=4096,
        incremental_len=25904,
        threshold=19400.0,
        link_utilisation=0.1,
        queue_prfaas=0,
        queue_pd=0,
        cluster=cluster,
        prefill_worker=f"{cluster}-prefill-0",
        decode_worker="pd-decode-0",
        bandwidth_scarce=False,
        reason="l > t",
    )
    return t.RoutingDecision(**(fields | kw))


def done(
    ts: float, ttft: float, rid: str = "r1", prompt: int = 1000, cached: int = 0
) -> t.RequestDone:
    return t.RequestDone(
        ts=ts,
        source="router",
        request_id=rid,
        cluster="pd",
        ttft_s=ttft,
        tpot_s=0.02,
        e2e_s=ttft + 1,
        prompt_tokens=prompt,
        output_tokens=50,
        cached_tokens=cached,
        ok=True,
    )


def link(ts: float, throughput: float, bandwidth: float = 10e9, name: str = "wan") -> t.LinkStats:
    return t.LinkStats(
        ts=ts,
        source=name,
        link=name,
        bandwidth_bps=bandwidth,
        delay_s=0.005,
        jitter_s=0.0,
        loss=0.0,
        up=True,
        throughput_bps=throughput,
        utilisation=throughput / bandwidth,
        queued_bytes=0,
        stalls=0,
    )


FlowPhase = Literal["start", "progress", "done", "failed"]


def flow(ts: float, rid: str, phase: FlowPhase, done_layers: int = 0) -> t.KVFlow:
    return t.KVFlow(
        ts=ts,
        source="p",
        request_id=rid,
        src="prfaas-prefill-0",
        dst="pd-decode-0",
        via_link="wan",
        phase=phase,
        layers_done=done_layers,
        layers_total=8,
        bytes_done=0,
        bytes_total=100,
        incremental=False,
        tokens_sent=10,
    )


def worker(ts: float, name: str = "pd-prefill-0", role: t.Role = "prefill") -> t.WorkerStatus:
    return t.WorkerStatus(
        ts=ts,
        source=name,
        worker=name,
        cluster="pd",
        role=role,
        queue_depth=1,
        running=1,
        busy=True,
        cached_blocks=3,
    )


def role_changed(ts: float, worker: str, old: WorkerRole, new: WorkerRole,
                 reason: str = "by hand") -> t.RoleChanged:
    return t.RoleChanged(ts=ts, source="router", worker=worker, old=old, new=new, reason=reason)


def threshold_changed(ts: float, old: float | None, new: float | None, policy: str = "prfaas",
                      reason: str = "by hand") -> t.ThresholdChanged:
    return t.ThresholdChanged(ts=ts, source="router", policy=policy, old=old, new=new,
                              reason=reason)
