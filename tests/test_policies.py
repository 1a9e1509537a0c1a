"""The fixed routing rules on hand-made inputs: homogeneous, naive-hetero, prfaas, dynamo."""

from __future__ import annotations

import pytest

from services.router.policies import create_policy
from services.router.policy import PolicyError, PrfaasSite, RouteInputs
from services.router.static_policies import (
    DynamoConfig,
    DynamoPolicy,
    HomogeneousPolicy,
    NaiveHeteroPolicy,
    PrfaasConfig,
    PrfaasPolicy,
    threshold_rule,
)

SCARCE = 0.9  # link utilisation above the default abundant_below (0.5)
ABUNDANT = 0.1


def inputs(total: int, prfaas: int = 0, pd: int = 0, util: float = ABUNDANT, *,
           queue: int = 0, stalls: int = 0, available: bool = True) -> RouteInputs:
    site = PrfaasSite(name="prfaas", cached=prfaas, queue=queue, link_utilisation=util,
                      link_stalls=stalls, available=available)
    return RouteInputs(request_id="r", total_len=total, cached_pd=pd, prfaas_sites=(site,))


def test_the_site_picked_is_the_available_one_with_the_longest_cache_then_the_calmest_link(
) -> None:
    policy = PrfaasPolicy()

    def picked(*sites: PrfaasSite) -> RouteInputs:
        return policy.pick_prfaas_site(RouteInputs(request_id="r", total_len=9_000,
                                                   prfaas_sites=sites))

    a, b = PrfaasSite(name="a", cached=512), PrfaasSite(name="b", cached=1024)
    assert picked(a, b).site == b
    assert picked(a, PrfaasSite(name="b", cached=1024, available=False)).site == a
    calm = PrfaasSite(name="c", cached=512, link_utilisation=0.05)
    assert picked(PrfaasSite(name="a", cached=512, link_utilisation=0.4), calm).site == calm
    none = picked(PrfaasSite(name="a", available=False), PrfaasSite(name="b", available=False))
    assert (none.site.name, none.site.available) == ("a", False)
    decision = policy.decide(none)
    assert decision.cluster == "pd" and "unavailable" in decision.reason


def test_homogeneous_keeps_everything_local() -> None:
    policy = HomogeneousPolicy()
    for total, pd in ((100, 0), (120_000, 0), (50_000, 40_000)):
        d = policy.decide(inputs(total, prfaas=total, pd=pd))
        assert (d.cluster, d.counted_prefix, d.incremental_len) == ("pd", pd, total - pd)
        assert d.threshold is None and not d.cross_cluster_cache_transfer
    assert policy.statistics().offload_fraction == 0.0


def test_naive_hetero_offloads_everything_and_falls_back_when_unavailable() -> None:
    policy = NaiveHeteroPolicy()
    short = policy.decide(inputs(10, prfaas=0, pd=8))
    assert (short.cluster, short.incremental_len, short.resume_prefix) == ("prfaas", 10, 0)
    down = policy.decide(inputs(5000, prfaas=0, pd=1000, available=False))
    assert (down.cluster, down.incremental_len) == ("pd", 4000)
    assert "unavailable" in down.reason
    assert policy.statistics().offload_fraction == 0.5


@pytest.mark.parametrize(
    ("total", "expected"), [(19_400, "pd"), (19_401, "prfaas"), (128, "pd"), (131_072, "prfaas")]
)
def test_prfaas_threshold_boundary_is_l_greater_than_t(total: int, expected: str) -> None:
    policy = PrfaasPolicy(PrfaasConfig(threshold=19_400))
    assert policy.decide(inputs(total)).cluster == expected


def test_scarce_rule_judges_each_cluster_cache_on_its_own() -> None:
    # 30K prompt, 25K cached in PrfaaS only; scarce: l = 30K - l_pd = 30K > t -> PrfaaS,
    # which resumes from its own 25K; no cache crosses the link.
    d = PrfaasPolicy(PrfaasConfig(threshold=10_000)).decide(inputs(30_000, 25_000, 0, SCARCE))
    assert d.bandwidth_scarce
    assert (d.cluster, d.counted_prefix, d.incremental_len) == ("prfaas", 0, 30_000)
    assert d.resume_prefix == 25_000 and not d.cross_cluster_cache_transfer
    # 30K prompt, 25K cached in PD: scarce counts l_pd -> l = 5K <= t -> PD prefill.
    d = PrfaasPolicy(PrfaasConfig(threshold=10_000)).decide(inputs(30_000, 0, 25_000, SCARCE))
    assert (d.cluster, d.incremental_len, d.resume_prefix) == ("pd", 5_000, 25_000)


def test_abundant_rule_counts_the_best_cache_and_schedules_a_transfer() -> None:
    policy = PrfaasPolicy(PrfaasConfig(threshold=10_000))
    # Best cache in PrfaaS (25K): l = 5K <= t -> PD prefill, pulling 25K from PrfaaS.
    d = policy.decide(inputs(30_000, 25_000, 2_000, ABUNDANT))
    assert not d.bandwidth_scarce
    assert (d.cluster, d.counted_prefix, d.incremental_len) == ("pd", 25_000, 5_000)
    assert d.resume_prefix == 25_000 and d.cross_cluster_cache_transfer
    assert "pull 23,000 cached tokens from prfaas" in d.reason
    # Best cache in PD (15K) but l = 45K > t -> PrfaaS computes, PD's 15K crosses over.
    d = policy.decide(inputs(60_000, 1_000, 15_000, ABUNDANT))
    assert (d.cluster, d.incremental_len, d.resume_prefix) == ("prfaas", 45_000, 15_000)
    assert d.cross_cluster_cache_transfer
    # The compute cluster already holds the longest cache: nothing to transfer.
    d = policy.decide(inputs(60_000, 20_000, 15_000, ABUNDANT))
    assert (d.cluster, d.resume_prefix, d.cross_cluster_cache_transfer) == (
        "prfaas", 20_000, False)


def test_the_same_request_routes_differently_under_scarce_and_abundant_bandwidth() -> None:
    request = inputs(40_000, prfaas=35_000, pd=0)
    scarce = threshold_rule(request, 19_400, scarce=True)
    abundant = threshold_rule(request, 19_400, scarce=False)
    assert (scarce.cluster, scarce.incremental_len) == ("prfaas", 40_000)
    assert (abundant.cluster, abundant.incremental_len) == ("pd", 5_000)


@pytest.mark.parametrize("name", ["prfaas", "prfaas-dynamic"])
def test_the_reason_names_the_link_state_the_rule_came_from(name: str) -> None:
    """Issue 15.3: an idle link reads "link calm", a loaded or stalling one "link busy", with
    the utilisation the policy saw; never "scarce" on a calm link."""
    policy = create_policy(name, {})
    calm = policy.decide(inputs(30_000, util=0.03)).reason
    assert "link calm (util 3% < 50%): best cache anywhere counts" in calm
    assert "scarce" not in calm and "busy" not in calm
    busy = policy.decide(inputs(30_000, util=0.85)).reason
    assert "link busy (util 85% >= 50%): PD cache counts" in busy
    stalled = policy.decide(inputs(30_000, util=0.03, stalls=2)).reason
    assert "link busy (2 recent stalls, util 3%): PD cache counts" in stalled
    pinned = create_policy(name, {"prefix_rule": "scarce"}).decide(inputs(30_000, util=0.03))
    assert "bandwidth pinned scarce: PD cache counts" in pinned.reason


def test_prfaas_pinned_modes_and_unavailable() -> None:
    pinned = PrfaasPolicy(PrfaasConfig(threshold=1_000, prefix_rule="scarce"))
    assert pinned.decide(inputs(5_000, 4_500, 0, ABUNDANT)).cluster == "prfaas"
    pinned = PrfaasPolicy(PrfaasConfig(threshold=1_000, prefix_rule="abundant"))
    assert pinned.decide(inputs(5_000, 4_500, 0, SCARCE)).cluster == "pd"
    d = PrfaasPolicy().decide(inputs(100_000, available=False))
    assert d.cluster == "pd" and "unavailable" in d.reason


@pytest.mark.parametrize("name", ["prfaas", "prfaas-dynamic"])
def test_the_prefix_rules_old_name_bandwidth_still_sets_it(name: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """`bandwidth` (the option's name before `prefix_rule`) is read as `prefix_rule`, with a
    logged deprecation; both at once, or a value that is no rule, are refused by name."""
    with caplog.at_level("WARNING"):
        policy = create_policy(name, {"bandwidth": "scarce"})
    assert policy.config.prefix_rule == "scarce"  # type: ignore[attr-defined]
    assert "'bandwidth' is deprecated, call it 'prefix_rule'" in caplog.text
    with pytest.raises(PolicyError, match="prefix_rule"):
        create_policy(name, {"prefix_rule": "sometimes"})
    with pytest.raises(PolicyError, match="prefix_rule"):
        create_policy(name, {"bandwidth": "sometimes"})
    with pytest.raises(PolicyError, match="not also its deprecated name bandwidth='abundant'"):
        create_policy(name, {"prefix_rule": "scarce", "bandwidth": "abundant"})


def test_dynamo_remote_iff_long_and_queue_short() -> None:
    policy = DynamoPolicy(DynamoConfig(max_local_prefill_length=1000, max_prefill_queue_size=3))
    assert policy.threshold == 1000
    local = policy.decide(inputs(1500, pd=600))  # 900 uncached <= 1000
    assert (local.cluster, local.incremental_len) == ("pd", 900)
    remote = policy.decide(inputs(1500, pd=400, queue=2))  # 1100 > 1000, queue 2 < 3
    assert remote.cluster == "prfaas" and "> local limit 1,000" in remote.reason
    # Dynamo reads the decode side's prefix into the remote prefill: a cross-cluster transfer.
    assert remote.resume_prefix == 400 and remote.cross_cluster_cache_transfer
    busy = policy.decide(inputs(1500, pd=400, queue=3))
    assert busy.cluster == "pd" and "remote queue 3 >= 3" in busy.reason


def test_dynamo_ignores_bandwidth_and_the_prfaas_cache() -> None:
    policy = DynamoPolicy()
    # A huge PrfaaS cache does not count; scarce bandwidth does not stop offloading.
    d = policy.decide(inputs(50_000, prfaas=49_000, pd=0, util=SCARCE))
    assert (d.cluster, d.incremental_len, d.counted_prefix) == ("prfaas", 50_000, 0)
    assert d.bandwidth_scarce
