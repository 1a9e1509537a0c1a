"""`prfaas-dynamic` on virtual time: the short-term t loop and the long-term role loop.

Time is the `now` the test passes in. The link is what the router measures of it
(`LinkEstimate`): a fluid model of senders whose KV drains at the link's rate feeds the live
`BandwidthEstimator` the counters the workers report, so the policy sees only what a router
sees, never the rate the line is set to.
"""

from __future__ import annotations

import math
import random
from typing import Literal

import msgspec
import pytest

from services.paper.hardware import CostModel
from services.paper.planner import ClusterShape
from services.paper.workload import TruncatedLogNormal
from services.router.dynamic_policy import DynamicConfig, PrfaasDynamicPolicy
from services.router.link_meter import BandwidthEstimator, EstimatorConfig, LinkEstimate
from services.router.policy import (
    ClusterState,
    ConvertWorker,
    LinkSample,
    PolicyError,
    RouteInputs,
    SetThreshold,
    WorkerSnapshot,
)
from services.router.role_balancer import RoleConfig

NOMINAL = 100e9


class FluidSenders:
    """Offloaded requests' KV bits queue at the senders and drain at `rate_bps` per virtual
    second; the counters a prefill worker reports (bytes accepted, seconds held) follow."""

    def __init__(self) -> None:
        self.rate_bps = NOMINAL
        self.backlog = 0.0
        self.kv = CostModel.load("h200")
        self.delivered = 0
        self.held_s = 0.0
        self.estimator = BandwidthEstimator(EstimatorConfig(provisioned_bps=NOMINAL), "link-0")

    def second(self, now: float, offloaded: list[int]) -> LinkEstimate:
        self.backlog += sum(8.0 * self.kv.kv_bytes(n) for n in offloaded)
        sent = min(self.backlog, self.rate_bps)
        self.backlog -= sent
        self.delivered += round(sent / 8)
        # Held while bits are left queued at the end of the second (the link was the limit).
        self.held_s += 1.0 if self.backlog > 0 else 0.0
        return self.estimator.observe(now, {"x0": (self.delivered, self.held_s)})


def quiet_policy(**options: object) -> PrfaasDynamicPolicy:
    """A policy whose window never fills (t is solved on the initial distribution), its
    long-term loop off unless `roles` is given."""
    options.setdefault("roles", RoleConfig(enabled=False))
    options.setdefault("min_samples", 10**6)
    return PrfaasDynamicPolicy(DynamicConfig(**options))  # type: ignore[arg-type]


def run(policy: PrfaasDynamicPolicy, link: FluidSenders, rng: random.Random, start: int,
        seconds: int, per_second: int = 3) -> tuple[float, list[tuple[int, SetThreshold]]]:
    """Drive `seconds` of arrivals; returns (offloaded share, threshold moves and when)."""
    lengths = TruncatedLogNormal.paper()
    offloaded = total = 0
    moves: list[tuple[int, SetThreshold]] = []
    for now in range(start, start + seconds):
        sent = []
        for i in range(per_second):
            inputs = RouteInputs(request_id=f"{now}-{i}", total_len=lengths.sample(rng),
                                 now=now)
            decision = policy.decide(inputs)
            if decision.cluster == "prfaas":
                sent.append(decision.incremental_len)
        offloaded, total = offloaded + len(sent), total + per_second
        policy.observe(link.second(now, sent))
        moves += [(now, a) for a in policy.tick(now, ClusterState())
                  if isinstance(a, SetThreshold)]
        policy.check_integrity()
    return offloaded / total, moves


def estimate(now: float, available_bps: float, provisioned_bps: float = NOMINAL,
             ) -> LinkEstimate:
    return LinkEstimate(now=now, link="link-0", available_bps=available_bps,
                        provisioned_bps=provisioned_bps)


def test_initial_t_comes_from_the_planner() -> None:
    policy = PrfaasDynamicPolicy()
    # The paper's case study: t* = 19.4K (Table 6), solved at B_out * (1 - headroom) = 80 Gbps.
    assert policy.threshold == pytest.approx(19_400, rel=0.01)
    scaled = PrfaasDynamicPolicy(DynamicConfig(token_scale=1 / 64))
    assert scaled.threshold == pytest.approx(19_400 / 64, rel=0.01)


def test_a_measured_bandwidth_cut_raises_t_offloads_less_and_recovers_settled() -> None:
    """The link drops to 4 Gbps for 10 minutes: the router measures it from its senders'
    counters alone, t rises, offloading falls; back at 100 Gbps, t comes back. After each
    change, once settled, t stays within 20 % of its level (no swings)."""
    policy, link, rng = quiet_policy(min_samples=50), FluidSenders(), random.Random(7)
    share_before, _ = run(policy, link, rng, 0, 300, per_second=2)
    t_before = policy.threshold
    assert t_before is not None
    link.rate_bps = 4e9
    share_during, moves = run(policy, link, rng, 300, 600, per_second=2)
    t_during = policy.threshold
    # Eq. 7 at 4 Gbps wants more; at 2 req/s the PD-side bound (75 %) holds t at 1.28 x.
    assert t_during is not None and t_during > 1.2 * t_before
    assert t_during == pytest.approx(policy.statistics().wanted_t, rel=0.1)
    assert share_during < 0.9 * share_before
    assert moves and "Eq. 7 t" in moves[0][1].reason
    assert 4e9 * 0.85 <= policy.statistics().measured_bps <= 4e9 * 1.15
    # Settled within two minutes of the cut; from then on no move leaves 20 % of its level.
    settled = [m.new for at, m in moves if m.new is not None and at >= 300 + 120]
    assert all(abs(new - t_during) <= 0.2 * t_during for new in settled)
    link.rate_bps = NOMINAL
    run(policy, link, rng, 900, 300, per_second=2)
    t_after = policy.threshold
    assert t_after is not None and abs(t_after - t_before) <= 0.2 * t_before


def test_the_waits_tilt_t_toward_the_side_that_waits_less_and_no_further_than_tilt() -> None:
    t0 = quiet_policy().threshold
    assert t0 is not None
    long_prfaas = quiet_policy()
    long_prfaas.tick(0.0, pd_state(prfaas_queue=40))
    assert long_prfaas.threshold is not None and long_prfaas.threshold > 1.2 * t0
    long_pd = quiet_policy()
    long_pd.tick(0.0, pd_state(pd_queue=20))
    assert long_pd.threshold is not None and long_pd.threshold < t0 / 1.2
    for _ in range(20):  # however long it lasts, t stays within the tilt of Eq. 7's
        long_pd.tick(100.0 * (_ + 1), pd_state(pd_queue=1000))
    assert long_pd.threshold >= t0 / 2.0 * 0.99


def test_a_narrow_link_never_plans_pd_prefill_past_its_bound() -> None:
    """At 2.6 req/s through a 5 Gbps link, Eq. 7 alone would keep more than PD prefill can
    take; the PD bound caps t so that PD prefill stays within pd_load_max (Eq. 4)."""
    lengths = TruncatedLogNormal.paper()
    capped, free = quiet_policy(min_samples=50), quiet_policy(min_samples=50,
                                                              pd_load_max=1e9)
    for policy in (capped, free):
        rng = random.Random(3)
        for i in range(780):  # 300 s at 2.6 req/s; the link drops to 5 Gbps after 100 s
            now = i / 2.6
            policy.decide(RouteInputs(request_id=f"r{i}", total_len=lengths.sample(rng),
                                      now=now))
            if i % 3 == 0:
                policy.observe(estimate(now, 5e9 if now >= 100 else NOMINAL))
                policy.tick(now, ClusterState())
    t_capped, t_free = capped.threshold, free.threshold
    assert t_capped is not None and t_free is not None and t_capped < t_free
    window = capped.lengths()
    kept = 1.0 - window.survival(t_capped)
    short, _ = window.conditional_means(t_capped)
    load = 2.6 * kept / capped._model.theta_pd_p(short, 3)
    assert load <= 0.9 * 1.1  # within the bound (one move of slack: min_rel_change)
    out = capped.statistics()
    assert out.wanted_t is not None and out.wanted_t <= t_capped * 1.1


def test_the_policy_never_sees_the_rate_the_line_is_set_to() -> None:
    """What the transport tells (`LinkSample`) has no rate; the bandwidth reaches the policy
    only as the router's own estimate."""
    assert "bandwidth_bps" not in LinkSample.__struct_fields__
    assert "utilisation" not in LinkSample.__struct_fields__
    policy = quiet_policy()
    policy.observe(LinkSample(now=0.0, stalls=0))
    t0 = policy.threshold
    policy.observe(estimate(1.0, 10e9))
    policy.tick(1.0, ClusterState())
    assert policy.threshold != t0  # the estimate moves t ...
    assert policy.statistics().measured_bps == 10e9


def test_override_pins_t_against_both_loops() -> None:
    policy = quiet_policy()
    policy.set_threshold_override(5000.0)
    for now in range(30):
        policy.observe(estimate(now, 1e9))
        assert not [a for a in policy.tick(now, pd_state(pd_queue=50))
                    if isinstance(a, SetThreshold)]
    decision = policy.decide(RouteInputs(request_id="r", total_len=6000))
    assert (decision.cluster, decision.threshold) == ("prfaas", 5000.0)


def pd_state(prfaas_queue: int = 0, pd_queue: int = 0, decode_queue: int = 0,
             draining: bool = False, n_p: int = 3, n_d: int = 5) -> ClusterState:
    workers = [WorkerSnapshot(name=f"x{i}", kind="prfaas", role="prefill",
                           queue=prfaas_queue if i == 0 else 0) for i in range(4)]
    workers += [WorkerSnapshot(name=f"p{i}", kind="pd", role="prefill", queue=pd_queue,
                            running=i) for i in range(n_p)]
    workers += [WorkerSnapshot(name=f"d{i}", kind="pd", role="decode", queue=decode_queue,
                            running=5 - i) for i in range(n_d)]
    if draining:
        workers.append(WorkerSnapshot(name="busy", kind="pd", role="draining"))
    return ClusterState(workers=tuple(workers))


def sustain(policy: PrfaasDynamicPolicy, state: ClusterState, seconds: int,
            rate: float = 1.5, start: int = 0) -> list[object]:
    """`seconds` of ticks in `state`, `rate` requests decided a second (the paper's lengths,
    seeded): the measured load a conversion must still carry."""
    rng, lengths = random.Random(5), TruncatedLogNormal.paper()
    actions: list[object] = []
    for now in range(start, start + seconds + 1):
        for i in range(round(rate * (now + 1)) - round(rate * now)):
            policy.decide(RouteInputs(request_id=f"{now}-{i}", total_len=lengths.sample(rng),
                                      now=float(now)))
        actions += policy.tick(float(now), state)
    return actions


def roles_policy(**roles: object) -> PrfaasDynamicPolicy:
    return PrfaasDynamicPolicy(DynamicConfig(
        min_samples=10**6, roles=RoleConfig(period_s=60.0, **roles)))  # type: ignore[arg-type]


def test_decode_backlog_converts_a_prefill_worker_and_t_is_resolved_lower() -> None:
    policy = roles_policy()
    t0 = policy.threshold
    assert t0 is not None
    actions = sustain(policy, pd_state(decode_queue=6), 120)
    conversions = [a for a in actions if isinstance(a, ConvertWorker)]
    assert conversions == [ConvertWorker(
        worker="p0", from_role="prefill", to_role="decode", reason=conversions[0].reason)]
    assert "decode is the bottleneck" in conversions[0].reason
    (move,) = [a for a in actions if isinstance(a, SetThreshold)]
    # N_p 3 -> 2: less PD prefill, so more must go to PrfaaS (planner: 19.4K -> 15.5K).
    assert move.new is not None and move.new == pytest.approx(15_478, rel=0.01)
    assert policy.statistics().conversions == 1 and policy.statistics().n_p == 2


def test_a_decode_backlog_its_workers_report_converts_as_a_counted_one() -> None:
    # The worker table gives a decode worker's backlog as what it reported waiting.
    reported = ClusterState(workers=tuple(
        msgspec.structs.replace(w, queue=0, waiting=w.queue) if w.role == "decode" else w
        for w in pd_state(decode_queue=6).workers))
    actions = sustain(roles_policy(), reported, 120)
    conversions = [a for a in actions if isinstance(a, ConvertWorker)]
    assert [(c.worker, c.to_role) for c in conversions] == [("p0", "decode")]


def test_t_is_solved_for_the_shape_a_pending_conversion_leaves() -> None:
    policy = roles_policy()
    sustain(policy, pd_state(decode_queue=6), 120)  # converts p0 to decode
    def with_p0(role: Literal["prefill", "decode", "draining"]) -> ClusterState:
        return ClusterState(workers=tuple(
            w if w.name != "p0" else WorkerSnapshot(name="p0", kind="pd", role=role)
            for w in pd_state(decode_queue=6).workers))

    policy.tick(121.0, with_p0("draining"))
    assert (policy.statistics().n_p, policy.statistics().n_d) == (2, 6)
    policy.tick(122.0, with_p0("decode"))  # done: the state itself has the new shape
    assert (policy.statistics().n_p, policy.statistics().n_d) == (2, 6)
    policy.tick(123.0, pd_state())  # the conversion is forgotten: the state's shape counts
    assert (policy.statistics().n_p, policy.statistics().n_d) == (3, 5)


def test_prefill_backlog_converts_a_decode_worker_and_t_rises() -> None:
    policy = roles_policy()
    actions = sustain(policy, pd_state(pd_queue=4), 120)
    (conversion,) = [a for a in actions if isinstance(a, ConvertWorker)]
    # The least loaded decode worker: d4 runs 1 request (d0 runs 5).
    assert (conversion.worker, conversion.to_role) == ("d4", "prefill")
    (move,) = [a for a in actions if isinstance(a, SetThreshold) and "long-term" in a.reason]
    # N_p 3 -> 4: more PD prefill, so PrfaaS keeps only longer requests (19.4K -> 22.9K).
    assert move.new == pytest.approx(22_888, rel=0.01)


@pytest.mark.parametrize(
    "state",
    [
        pd_state(decode_queue=6, draining=True),  # a conversion is still in progress
        pd_state(decode_queue=6, n_p=1),  # the last prefill worker is never converted
        pd_state(decode_queue=3, pd_queue=2),  # 3 < 2 x 2: not imbalanced enough
        pd_state(decode_queue=1),  # below min_backlog
    ],
)
def test_no_conversion_when_draining_at_minimum_or_balanced(state: ClusterState) -> None:
    actions = sustain(roles_policy(), state, 130)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_conversion_waits_for_two_full_periods() -> None:
    policy = roles_policy()
    actions = sustain(policy, pd_state(decode_queue=6), 119)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_config_errors_name_the_option() -> None:
    with pytest.raises(PolicyError, match=r"tilt must be >= 1, got 0.5"):
        DynamicConfig(tilt=0.5)
    with pytest.raises(PolicyError, match=r"headroom must lie in \[0, 1\), got 1.0"):
        DynamicConfig(headroom=1.0)
    with pytest.raises(PolicyError, match=r"roles.period_s must be a finite number > 0"):
        RoleConfig(period_s=math.inf)
    with pytest.raises(PolicyError, match=r"prfaas_profile must model prefill time .*'cpu'"):
        PrfaasDynamicPolicy(DynamicConfig(prfaas_profile="cpu"))


def test_eq8_out_of_balance_converts_within_three_periods_and_t_is_resolved() -> None:
    """Short requests only (all under t), one a second: PD prefill outruns decode by far
    (Eq. 8), with no queue backed up anywhere. On virtual time, the long-term loop converts
    one PD prefill worker to decode at the end of the second period that wants it (within
    three), then re-solves t for the new shape."""
    policy = PrfaasDynamicPolicy(DynamicConfig(
        min_samples=20, roles=RoleConfig(period_s=30.0)))
    for i in range(40):  # the recent lengths: 2K to 4K tokens
        policy.decide(RouteInputs(request_id=f"r{i}", total_len=2_000 + 50 * i))
    state = pd_state(n_p=2, n_d=2)
    solves = policy.statistics().solves
    actions: list[object] = []
    for now in range(91):
        policy.decide(RouteInputs(request_id=f"s{now}", total_len=2_000 + 50 * (now % 40),
                                  now=float(now)))
        actions += policy.tick(float(now), state)
        if any(isinstance(a, ConvertWorker) for a in actions):
            break
    (conversion,) = [a for a in actions if isinstance(a, ConvertWorker)]
    assert 60 <= now <= 90 and (conversion.from_role, conversion.to_role) == ("prefill",
                                                                               "decode")
    assert "Eq. 8" in conversion.reason and "decode is the bottleneck" in conversion.reason
    assert policy.statistics().solves > solves  # t re-solved for N_p / N_d = 1 / 3
    assert (policy.statistics().n_p, policy.statistics().n_d) == (1, 3)
    rates = policy._roles.last_rates
    assert rates is not None and rates[0] + rates[1] > 1.3 * rates[2]


def test_balanced_eq8_converts_nothing() -> None:
    policy = PrfaasDynamicPolicy(DynamicConfig(min_samples=10**6,
                                               roles=RoleConfig(period_s=30.0)))
    actions = sustain(policy, pd_state(), 130)  # the paper's shape: 3.25 vs 3.91 req/s
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_a_conversion_is_not_undone_within_the_cooldown() -> None:
    """Decode backs up for a period (p0 becomes a decode worker), then PD prefill does: the
    next period would convert one back (flapping); within `cooldown_s` it does not."""
    policy = roles_policy()
    first = [a for a in sustain(policy, pd_state(decode_queue=6), 120)
             if isinstance(a, ConvertWorker)]
    assert [(c.worker, c.to_role) for c in first] == [("p0", "decode")]
    after = sustain(policy, pd_state(pd_queue=4, n_p=2, n_d=6), 150, start=121)
    assert not [a for a in after if isinstance(a, ConvertWorker)]
    eager = roles_policy(cooldown_s=0.0)
    sustain(eager, pd_state(decode_queue=6), 120)
    back = sustain(eager, pd_state(pd_queue=4, n_p=2, n_d=6), 150, start=121)
    assert "prefill" in [c.to_role for c in back if isinstance(c, ConvertWorker)]


def test_no_conversion_leaves_a_role_short_of_the_load_it_carries() -> None:
    """Decode is backed up, but at 2.6 req/s two PD prefill workers could not take PD
    prefill's share: the load on N-1 is predicted, and p0 stays."""
    policy = roles_policy()
    actions = sustain(policy, pd_state(decode_queue=6), 130, rate=2.6)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_without_traffic_the_long_term_loop_settles() -> None:
    """No request for 20 minutes on a shape far from Eq. 8's balance: the model alone would
    convert; with nothing measured, nothing is converted, and t, once solved for the shape
    the workers report, stays where it is."""
    policy = roles_policy()
    actions = sustain(policy, pd_state(n_p=1, n_d=7), 1200, rate=0.0)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]
    settled = policy.threshold
    later = sustain(policy, pd_state(n_p=1, n_d=7), 600, rate=0.0, start=1201)
    assert later == [] and policy.threshold == settled


def test_a_load_that_changes_faster_than_a_period_is_not_chased() -> None:
    """Decode and PD prefill back up by turns, 20 s each: over a period neither stands out,
    so nothing is converted."""
    policy = roles_policy()
    actions: list[object] = []
    for start in range(0, 600, 20):
        state = pd_state(decode_queue=6) if (start // 20) % 2 else pd_state(pd_queue=6)
        actions += sustain(policy, state, 19, start=start)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_under_a_light_load_eq8_keeps_the_deployed_split() -> None:
    """One PD prefill worker against seven decode workers, far from Eq. 8's balance. At 0.2
    req/s no stage is `min_load` busy: the split limits nothing and is kept (its headroom is
    what a burst needs). At 2 req/s the same shape converts decode workers to prefill."""
    light = roles_policy()
    actions = sustain(light, pd_state(n_p=1, n_d=7), 300, rate=0.2)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]
    loads = light._loads(ClusterShape(4, 1, 7))
    assert loads is not None and max(loads) < light.config.roles.min_load
    busy = roles_policy()
    actions = sustain(busy, pd_state(n_p=1, n_d=7), 300, rate=2.0)
    moves = {(c.from_role, c.to_role) for c in actions if isinstance(c, ConvertWorker)}
    assert moves == {("decode", "prefill")}
