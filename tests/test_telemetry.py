"""Every dashboard event round-trips through its JSON form."""

from __future__ import annotations

import msgspec
import pytest

from services.contract import events as t

SAMPLES: list[t.Event] = [
    t.RoutingDecision(
        ts=1.0,
        source="router",
        request_id="r1",
        policy="prfaas",
        total_len=30000,
        cached_prfaas=0,
        cached_pd=4096,
        incremental_len=25904,
        threshold=19400.0,
        link_utilisation=0.12,
        queue_prfaas=1,
        queue_pd=0,
        cluster="prfaas",
        prefill_worker="prfaas-prefill-0",
        decode_worker="pd-decode-0",
        bandwidth_scarce=True,
        reason="l = 25904 > t = 19400: offload",
    ),
    t.KVFlow(
        ts=2.0,
        source="prfaas-prefill-0",
        request_id="r1",
        src="prfaas-prefill-0",
        dst="pd-decode-0",
        via_link="link-0",
        phase="progress",
        layers_done=3,
        layers_total=8,
        bytes_done=1000,
        bytes_total=4000,
        incremental=False,
        tokens_sent=30000,
    ),
    t.LinkStats(
        ts=3.0,
        source="link-0",
        link="link-0",
        bandwidth_bps=1e9,
        delay_s=0.02,
        jitter_s=0.0,
        loss=0.0,
        up=True,
        throughput_bps=2e8,
        utilisation=0.2,
        queued_bytes=0,
        stalls=0,
    ),
    t.WorkerStatus(
        ts=4.0,
        source="pd-decode-0",
        worker="pd-decode-0",
        cluster="pd",
        role="decode",
        queue_depth=0,
        running=3,
        busy=True,
        cached_blocks=12,
    ),
    t.RequestPhase(ts=5.0, source="router", request_id="r1", phase="decode", worker="pd-decode-0"),
    t.RequestDone(
        ts=6.0,
        source="router",
        request_id="r1",
        cluster="prfaas",
        ttft_s=0.5,
        tpot_s=0.02,
        e2e_s=1.8,
        prompt_tokens=30000,
        output_tokens=64,
        cached_tokens=0,
        ok=True,
    ),
    t.ThresholdChanged(
        ts=7.0,
        source="router",
        policy="prfaas-dynamic",
        old=19400.0,
        new=25000.0,
        reason="egress utilisation 0.93 > 0.8",
    ),
    t.RoleChanged(
        ts=8.0,
        source="router",
        worker="pd-prefill-1",
        old="prefill",
        new="decode",
        reason="decode is the bottleneck",
    ),
    t.RequestMigrated(
        ts=8.5,
        source="router",
        request_id="req-1",
        attempt=1,
        reason="decode_lost",
        failed_worker="pd-decode-0",
        prefill_worker="pd-prefill-0",
        decode_worker="pd-decode-1",
        cluster="pd",
        tokens_kept=12,
        detail="connection reset",
    ),
    t.CacheActivity(
        ts=9.0,
        source="cachedir",
        worker="pd-decode-0",
        cluster="pd",
        kind="stored",
        blocks=4,
        total_blocks=16,
    ),
]


def test_every_event_type_has_a_sample() -> None:
    assert {type(e) for e in SAMPLES} == set(t.EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_event_round_trips_through_json(event: t.Event) -> None:
    data = t.encode_json(event)
    assert msgspec.json.decode(data)["type"] == type(event).__struct_config__.tag
    assert t.decode_json(data) == event


def test_no_threshold_is_null_in_json() -> None:
    event = t.ThresholdChanged(
        ts=0.0, source="r", policy="homogeneous", old=1.0, new=None, reason="nothing offloaded"
    )
    assert b'"new":null' in t.encode_json(event)
    assert t.decode_json(t.encode_json(event)) == event


def test_bad_event_names_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match="total_len"):
        t.decode_json(b'{"type": "decision", "ts": 0, "source": "r", "total_len": "x"}')
