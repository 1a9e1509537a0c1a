"""Every dashboard event round-trips through its JSON form."""

from __future__ import annotations

import msgspec
import pytest

from services.contract import events as t
from tests import dashboard_events as ev

SAMPLES: list[t.Event] = [
    ev.decision(1.0, link_utilisation=0.12, queue_prfaas=1, bandwidth_scarce=True,
                reason="l = 25904 > t = 19400: offload"),
    ev.flow(2.0, "r1", "progress", done_layers=3),
    ev.link(3.0, throughput=2e8, bandwidth=1e9, name="link-0"),
    ev.worker(4.0, name="pd-decode-0", role="decode"),
    t.RequestPhase(ts=5.0, source="router", request_id="r1", phase="decode", worker="pd-decode-0"),
    ev.done(6.0, ttft=0.5, prompt=30000),
    ev.threshold_changed(7.0, 19400.0, 25000.0, policy="prfaas-dynamic",
                         reason="egress utilisation 0.93 > 0.8"),
    ev.role_changed(8.0, "pd-prefill-1", "prefill", "decode", reason="decode is the bottleneck"),
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
