"""The policy interface: input validation, the registry, events built from decisions."""

from __future__ import annotations

import math

import msgspec
import pytest

from services.contract.events import RoleChanged, ThresholdChanged, decode_json, encode_json
from services.router.policies import POLICIES, create_policy
from services.router.policy import (
    ClusterState,
    ConvertWorker,
    Decision,
    LinkSample,
    Policy,
    PolicyError,
    PrfaasSite,
    RequestFinished,
    RouteInputs,
    SetThreshold,
    WorkerSnapshot,
    action_event,
    decision_event,
)
from services.router.static_policies import format_tokens, is_bandwidth_scarce


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"total_len": -1}, "total_len must be >= 0, got -1"),
        ({"cached_pd": 11}, "cached_pd must be <= total_len=10, got 11"),
        ({"prfaas_sites": ()}, "site_index must index one of the 0 prfaas_sites, got 0"),
        ({"site_index": 1}, "site_index must index one of the 1 prfaas_sites, got 1"),
        ({"prfaas_sites": (PrfaasSite(name="a", cached=11),)},
         "PrfaaS site 'a': cached must be <= total_len=10, got 11"),
        ({"queue_pd": -1}, "queue_pd must be >= 0, got -1"),
        ({"now": math.inf}, "now must be finite, got inf"),
    ],
)
def test_route_inputs_reject_bad_values_naming_them(fields: dict[str, float],
                                                     message: str) -> None:
    base: dict[str, object] = {"request_id": "r", "total_len": 10}
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        RouteInputs(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cached": -2}, "PrfaaS site 'a': cached must be >= 0, got -2"),
        ({"queue": -1}, "PrfaaS site 'a': queue must be >= 0, got -1"),
        ({"link_stalls": -1}, "PrfaaS site 'a': link_stalls must be >= 0, got -1"),
        ({"link_utilisation": math.nan}, "link_utilisation must be a finite number >= 0"),
        ({"link_utilisation": -0.5}, "got -0.5"),
    ],
)
def test_prfaas_site_rejects_bad_values_naming_them(fields: dict[str, float],
                                                    message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        PrfaasSite(name="a", **fields)  # type: ignore[arg-type]


def test_bandwidth_rule_watermark_stalls_and_pinned_modes() -> None:
    def on(site: PrfaasSite) -> RouteInputs:
        return RouteInputs(request_id="r", total_len=1, prfaas_sites=(site,))

    calm = on(PrfaasSite(name="prfaas", link_utilisation=0.49))
    busy = on(PrfaasSite(name="prfaas", link_utilisation=0.5))
    stalled = on(PrfaasSite(name="prfaas", link_utilisation=0.1, link_stalls=1))
    assert not is_bandwidth_scarce(calm, 0.5)
    assert is_bandwidth_scarce(busy, 0.5)
    assert is_bandwidth_scarce(stalled, 0.5)
    assert is_bandwidth_scarce(calm, 0.5, "scarce")
    assert not is_bandwidth_scarce(stalled, 0.5, "abundant")


def test_registry_names_and_every_policy_implements_the_interface() -> None:
    assert set(POLICIES) == {"homogeneous", "naive-hetero", "prfaas", "prfaas-dynamic", "dynamo"}
    for name in POLICIES:
        policy: Policy = create_policy(name)
        assert policy.name == name
        decision = policy.decide(RouteInputs(request_id="r", total_len=50_000, cached_pd=100))
        assert decision.cluster in ("prfaas", "pd")
        assert decision.incremental_len == 50_000 - decision.counted_prefix
        policy.observe(RequestFinished(request_id="r", cluster=decision.cluster,
                                       incremental_len=decision.incremental_len, now=1.0))
        policy.observe(LinkSample(now=1.0, stalls=0))
        assert isinstance(policy.tick(1.0, ClusterState()), list)
        policy.check_integrity()
        stats = policy.statistics()
        assert (stats.decisions, stats.finished) == (1, 1)
        assert stats.to_prfaas + stats.to_pd == 1


def test_registry_refuses_unknown_names_and_options() -> None:
    with pytest.raises(PolicyError, match=r"policy must be one of .*got 'fastest'"):
        create_policy("fastest")
    with pytest.raises(PolicyError, match=r"policy 'prfaas': bad option: .*unknown field `t`"):
        create_policy("prfaas", {"t": 5})
    with pytest.raises(PolicyError, match=r"threshold must be a number >= 0, got -1"):
        create_policy("prfaas", {"threshold": -1})
    with pytest.raises(PolicyError, match=r"max_prefill_queue_size must be >= 0, got -3"):
        create_policy("dynamo", {"max_prefill_queue_size": -3})


def test_check_integrity_catches_inconsistent_counts() -> None:
    policy = create_policy("prfaas")
    policy.decide(RouteInputs(request_id="r", total_len=50_000))
    policy.check_integrity()
    policy._to_prfaas = 2  # type: ignore[attr-defined]  # corrupt it on purpose
    with pytest.raises(PolicyError, match=r"integrity: to_prfaas=2 outside 0..1"):
        policy.check_integrity()


def test_override_pins_t_and_is_refused_without_a_threshold() -> None:
    policy = create_policy("prfaas", {"threshold": 1000})
    inputs = RouteInputs(request_id="r", total_len=1500)
    assert policy.decide(inputs).cluster == "prfaas"
    policy.set_threshold_override(2000)
    assert policy.threshold == 2000
    assert policy.decide(inputs).cluster == "pd"
    assert policy.statistics().override == 2000
    policy.set_threshold_override(None)
    assert policy.threshold == 1000
    with pytest.raises(PolicyError, match=r"t must be a number >= 0 or None, got -5"):
        policy.set_threshold_override(-5)
    with pytest.raises(PolicyError, match=r"policy 'homogeneous' has no threshold"):
        create_policy("homogeneous").set_threshold_override(10)


def test_decision_event_carries_every_input_and_round_trips() -> None:
    site = PrfaasSite(name="prfaas", cached=512, link_utilisation=0.3, queue=2)
    inputs = RouteInputs(request_id="req-7", total_len=9000, cached_pd=1024, queue_pd=5,
                         now=3.0, prfaas_sites=(site,))
    decision = create_policy("prfaas", {"threshold": 4000}).decide(inputs)
    event = decision_event(inputs, decision, policy="prfaas", prefill_worker="prfaas-0",
                           decode_worker="decode-1", ts=3.0)
    assert decode_json(encode_json(event)) == event
    assert (event.request_id, event.total_len, event.cached_prfaas, event.cached_pd) == (
        "req-7", 9000, 512, 1024)
    assert (event.incremental_len, event.threshold, event.cluster) == (7976, 4000.0, "prfaas")
    assert (event.queue_prfaas, event.queue_pd, event.link_utilisation) == (2, 5, 0.3)
    assert (event.prefill_worker, event.decode_worker) == ("prfaas-0", "decode-1")
    assert event.reason == decision.reason and "7,976 > t = 4,000" in event.reason


def test_infinite_threshold_becomes_null_in_events() -> None:
    inputs = RouteInputs(request_id="r", total_len=10)
    decision = Decision(cluster="pd", counted_prefix=0, incremental_len=10, resume_prefix=0,
                        threshold=math.inf, bandwidth_scarce=False,
                        cross_cluster_cache_transfer=False, reason="x")
    event = decision_event(inputs, decision, policy="p", prefill_worker="a", decode_worker="b",
                           ts=0.0)
    assert event.threshold is None
    assert b'"threshold":null' in encode_json(event)


def test_action_events() -> None:
    moved = action_event(SetThreshold(old=math.inf, new=2500.0, reason="calm"), policy="p", ts=1)
    assert isinstance(moved, ThresholdChanged)
    assert (moved.old, moved.new, moved.reason) == (None, 2500.0, "calm")
    role = action_event(ConvertWorker(worker="pd-2", from_role="prefill", to_role="decode",
                                      reason="decode backlog"), policy="p", ts=2)
    assert isinstance(role, RoleChanged)
    assert (role.worker, role.old, role.new) == ("pd-2", "prefill", "decode")
    assert decode_json(encode_json(role)) == role


def test_cluster_state_select_and_load() -> None:
    state = ClusterState(workers=(
        WorkerSnapshot(name="a", kind="pd", role="prefill", queue=2, running=1),
        WorkerSnapshot(name="b", kind="pd", role="draining"),
        WorkerSnapshot(name="c", kind="prfaas", role="prefill"),
    ))
    assert [w.name for w in state.select("pd", "prefill")] == ["a"]
    assert state.select("pd", "prefill")[0].load == 3
    assert msgspec.json.decode(msgspec.json.encode(state), type=ClusterState) == state


def test_format_tokens() -> None:
    assert format_tokens(19400.4) == "19,400"
    assert (format_tokens(math.inf), format_tokens(-math.inf)) == ("inf", "-inf")
    assert format_tokens(None) == "none"
