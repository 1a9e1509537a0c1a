"""`prfaas-dynamic` on virtual time: the short-term t loop and the long-term role loop.

Time is the `now` the test passes in; the link is a small fluid model (a backlog drained at
the link rate each virtual second), with KV sizes from the paper's 1T-model profile.
"""

from __future__ import annotations

import math
import random
from typing import Literal

import msgspec
import pytest

from services.paper.hardware import CostModel
from services.paper.workload import TruncatedLogNormal
from services.router.policies import (
    ClusterState,
    ConvertWorker,
    DynamicConfig,
    LinkSample,
    PolicyError,
    PrfaasDynamicPolicy,
    RoleConfig,
    RouteInputs,
    SetThreshold,
    WorkerSnapshot,
    _toward,
)

NOMINAL = 100e9


class FluidLink:
    """Offloaded requests' KV bits queue up and drain at `rate_bps` per virtual second."""

    def __init__(self) -> None:
        self.rate_bps = NOMINAL
        self.backlog = 0.0
        self.kv = CostModel.load("h200")

    def second(self, offloaded: list[int]) -> float:
        self.backlog += sum(8.0 * self.kv.kv_bytes(n) for n in offloaded)
        sent = min(self.backlog, self.rate_bps)
        self.backlog -= sent
        return sent / self.rate_bps


def run(policy: PrfaasDynamicPolicy, link: FluidLink, rng: random.Random, start: int,
        seconds: int, per_second: int = 3) -> tuple[float, list[SetThreshold]]:
    """Drive `seconds` of arrivals; returns (offloaded share, threshold moves)."""
    lengths = TruncatedLogNormal.paper()
    offloaded = total = 0
    moves: list[SetThreshold] = []
    for now in range(start, start + seconds):
        sent = []
        for i in range(per_second):
            inputs = RouteInputs(request_id=f"{now}-{i}", total_len=lengths.sample(rng), now=now)
            decision = policy.decide(inputs)
            if decision.cluster == "prfaas":
                sent.append(decision.incremental_len)
        offloaded, total = offloaded + len(sent), total + per_second
        policy.observe(LinkSample(now=now, utilisation=link.second(sent),
                                  bandwidth_bps=link.rate_bps, stalls=0))
        moves += [a for a in policy.tick(now, ClusterState()) if isinstance(a, SetThreshold)]
        policy.check_integrity()
    return offloaded / total, moves


def test_initial_t_comes_from_the_planner() -> None:
    policy = PrfaasDynamicPolicy()
    # The paper's case study: t* = 19.4K (Table 6), solved at B_out * (1 - headroom) = 80 Gbps.
    assert policy.threshold == pytest.approx(19_400, rel=0.01)
    scaled = PrfaasDynamicPolicy(DynamicConfig(token_scale=1 / 64))
    assert scaled.threshold == pytest.approx(19_400 / 64, rel=0.01)


def test_bandwidth_cut_raises_t_and_offloading_falls_then_recovers() -> None:
    policy, link, rng = PrfaasDynamicPolicy(), FluidLink(), random.Random(7)
    t0 = policy.threshold
    assert t0 is not None
    before, _ = run(policy, link, rng, 0, 100)
    link.rate_bps = 8e9
    during, cut_moves = run(policy, link, rng, 100, 150)
    assert any(m.new is not None and m.new > 2 * t0 for m in cut_moves)
    assert any("congested (link utilisation" in m.reason for m in cut_moves)
    assert during < before - 0.25
    link.rate_bps = NOMINAL
    _, back = run(policy, link, rng, 250, 40)
    # Back within 15 % of its start within 40 s of the bandwidth's return.
    assert policy.threshold == pytest.approx(t0, rel=0.15)
    assert any("link calm" in m.reason for m in back)
    after, _ = run(policy, link, rng, 290, 100)
    assert policy.threshold == pytest.approx(t0, rel=0.15)
    assert after == pytest.approx(before, abs=0.08)


def quiet_policy(**options: object) -> PrfaasDynamicPolicy:
    """A policy whose window never fills (t is solved on the initial distribution), its
    long-term loop off unless `roles` is given (it re-balances Eq. 8 once t has moved)."""
    options.setdefault("roles", RoleConfig(enabled=False))
    return PrfaasDynamicPolicy(DynamicConfig(min_samples=10**6, **options))  # type: ignore[arg-type]


def link(now: float, utilisation: float, rate: float = NOMINAL, stalls: int = 0) -> LinkSample:
    return LinkSample(now=now, utilisation=utilisation, bandwidth_bps=rate, stalls=stalls)


def test_hysteresis_between_the_watermarks_nothing_moves() -> None:
    policy = quiet_policy(smoothing_s=0.0)
    t0 = policy.threshold
    for now in range(200):
        policy.observe(link(now, 0.55 + 0.2 * (now % 2)))  # 0.55 / 0.75: inside (0.5, 0.8)
        assert policy.tick(now, ClusterState()) == []
    assert policy.threshold == t0


def test_congestion_moves_at_most_once_per_dwell_and_only_up() -> None:
    policy = quiet_policy(smoothing_s=0.0, dwell_s=5.0)
    t0 = policy.threshold
    assert t0 is not None
    moves = []
    for now in range(10):
        policy.observe(link(now, 0.95))
        moves += policy.tick(now, ClusterState())
    assert len(moves) == 2  # at 0 and 5
    first = moves[0]
    assert isinstance(first, SetThreshold)
    # The model sees full bandwidth (same t), so the step (1.25) is what raises t.
    assert first.new == pytest.approx(1.25 * t0)
    assert policy.threshold == pytest.approx(1.25**2 * t0)


def test_stalls_raise_t_and_derate_the_bandwidth() -> None:
    policy = quiet_policy(smoothing_s=0.0)
    t0 = policy.threshold
    assert t0 is not None
    policy.observe(link(0.0, 0.1, stalls=3))
    assert policy.tick(0.0, ClusterState()) == []  # the first sample only sets the baseline
    policy.observe(link(1.0, 0.1, stalls=5))
    (move,) = policy.tick(1.0, ClusterState())
    assert isinstance(move, SetThreshold) and "transfer stalls" in move.reason
    assert move.new is not None and move.new > t0
    assert policy.effective_bandwidth_bps(1.0) == pytest.approx(NOMINAL * 0.8 * 0.5)
    assert policy.effective_bandwidth_bps(20.0) == pytest.approx(NOMINAL * 0.8)


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


def test_queue_surges_move_t_in_opposite_directions() -> None:
    policy = quiet_policy()
    t0 = policy.threshold
    assert t0 is not None
    (up,) = policy.tick(0.0, pd_state(prfaas_queue=8))
    assert isinstance(up, SetThreshold) and "PrfaaS queue 8 >= 8" in up.reason
    assert up.new == pytest.approx(1.25 * t0)
    other = quiet_policy()
    other.observe(link(0.0, 0.1))
    (down,) = other.tick(0.0, pd_state(pd_queue=3))  # 3 workers x 3 queued = 9 >= 8
    assert isinstance(down, SetThreshold) and "PD prefill queue 9" in down.reason
    assert down.new == pytest.approx(t0 / 1.25)


def raised_policy(now: int = 0, **options: object) -> PrfaasDynamicPolicy:
    """A quiet policy whose t a congested link pushed to 1.25^4 of its start by `now` + 15."""
    policy = quiet_policy(smoothing_s=0.0, **options)
    for second in range(now, now + 16):
        policy.observe(link(second, 0.95))
        policy.tick(second, ClusterState())
    return policy


def test_brief_pd_queue_spikes_do_not_hold_back_recovery() -> None:
    t0 = quiet_policy().threshold
    assert t0 is not None
    policy = raised_policy()
    assert policy.threshold == pytest.approx(1.25**4 * t0)
    moves = []
    for now in range(16, 56):
        policy.observe(link(now, 0.1))
        spike = 4 if now % 3 == 0 else 0  # 3 workers x 4 = 12 >= surge, one tick in three
        moves += policy.tick(now, pd_state(pd_queue=spike))
    # Calm from 16: moves at 26, 31, 36 (halfway in log space, then one step): 2.44 ->
    # 1.56 -> 1.25 -> 1, where one step a dwell would have needed four.
    thresholds = [m for m in moves if isinstance(m, SetThreshold)]
    assert len(thresholds) == len(moves)
    assert [m.new for m in thresholds] == pytest.approx([1.25**2 * t0, 1.25 * t0, t0])
    assert all("link calm for 10 s" in m.reason for m in thresholds)
    stats = policy.statistics()
    # The spikes are seen (their average is near surge / 2) but never restart the calm timer.
    assert stats.calm_since == 16 and stats.queue_pd > 2


def test_recovery_waits_while_the_side_it_would_load_is_busy() -> None:
    policy = raised_policy()
    t_high = policy.threshold
    for now in range(16, 60):  # PrfaaS queue 6 >= surge / 2: no slack to take more
        policy.observe(link(now, 0.1))
        assert policy.tick(now, pd_state(prfaas_queue=6)) == []
    assert policy.threshold == t_high
    for now in range(60, 80):  # the queue drains; its average falls under 4 within 5 s
        policy.observe(link(now, 0.1))
        if moves := policy.tick(now, pd_state()):
            break
    assert 60 < now <= 66 and isinstance(moves[0], SetThreshold)
    assert t_high is not None and moves[0].new == pytest.approx(t_high / 1.25**2)


def test_a_noisy_link_and_noisy_queues_move_nothing() -> None:
    policy, rng = quiet_policy(), random.Random(5)
    t0 = policy.threshold
    assert t0 is not None
    actions = []
    for now in range(600):
        # Raw samples cross both watermarks every few seconds; queues spike past the surge.
        policy.observe(link(now, min(1.0, max(0.0, rng.gauss(0.45, 0.25)))))
        spikes = [12 * (rng.random() < 0.1) for _ in range(2)]
        actions += policy.tick(now, pd_state(prfaas_queue=spikes[0], pd_queue=spikes[1] // 3))
        policy.check_integrity()
    assert actions == [] and policy.threshold == t0
    # A surge that persists is one: the PD queue held at 12 lowers t within 10 s.
    for now in range(600, 610):
        policy.observe(link(now, 0.3))
        actions += policy.tick(now, pd_state(pd_queue=4))
    (fall,) = actions
    assert isinstance(fall, SetThreshold) and "PD prefill queue" in fall.reason
    assert fall.new == pytest.approx(t0 / 1.25)


def test_a_recovery_move_is_halfway_in_log_space_at_least_a_step_never_past() -> None:
    assert _toward(10_000.0, 100.0, 1.25) == pytest.approx(1_000.0)
    assert _toward(100.0, 10_000.0, 1.25) == pytest.approx(1_000.0)
    assert _toward(120.0, 100.0, 1.25) == pytest.approx(100.0)
    assert _toward(200.0, 100.0, 1.25) == pytest.approx(141.42, rel=1e-4)
    assert _toward(140.0, 100.0, 1.25) == pytest.approx(112.0)  # halfway is under one step
    assert _toward(math.inf, 100.0, 1.25) == math.inf  # from "offload nothing": one step
    assert _toward(0.0, 100.0, 1.25) == pytest.approx(1.25)


def test_override_pins_t_against_both_loops() -> None:
    policy = quiet_policy(smoothing_s=0.0)
    policy.set_threshold_override(5000.0)
    for now in range(30):
        policy.observe(link(now, 1.0))
        assert not [a for a in policy.tick(now, ClusterState()) if isinstance(a, SetThreshold)]
    decision = policy.decide(RouteInputs(request_id="r", total_len=6000))
    assert (decision.cluster, decision.threshold) == ("prfaas", 5000.0)


def sustain(policy: PrfaasDynamicPolicy, state: ClusterState, seconds: int) -> list[object]:
    actions: list[object] = []
    for now in range(seconds + 1):
        actions += policy.tick(float(now), state)
    return actions


def roles_policy(**roles: object) -> PrfaasDynamicPolicy:
    return PrfaasDynamicPolicy(DynamicConfig(
        min_samples=10**6, roles=RoleConfig(period_s=60.0, **roles)))  # type: ignore[arg-type]


def test_decode_backlog_converts_a_prefill_worker_and_t_is_resolved_lower() -> None:
    policy = roles_policy()
    t0 = policy.threshold
    assert t0 is not None
    actions = sustain(policy, pd_state(decode_queue=6), 60)
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
    actions = sustain(roles_policy(), reported, 60)
    conversions = [a for a in actions if isinstance(a, ConvertWorker)]
    assert [(c.worker, c.to_role) for c in conversions] == [("p0", "decode")]


def test_t_is_solved_for_the_shape_a_pending_conversion_leaves() -> None:
    policy = roles_policy()
    sustain(policy, pd_state(decode_queue=6), 60)  # converts p0 to decode
    def with_p0(role: Literal["prefill", "decode", "draining"]) -> ClusterState:
        return ClusterState(workers=tuple(
            w if w.name != "p0" else WorkerSnapshot(name="p0", kind="pd", role=role)
            for w in pd_state(decode_queue=6).workers))

    policy.tick(61.0, with_p0("draining"))
    assert (policy.statistics().n_p, policy.statistics().n_d) == (2, 6)
    policy.tick(62.0, with_p0("decode"))  # done: the state itself has the new shape
    assert (policy.statistics().n_p, policy.statistics().n_d) == (2, 6)
    policy.tick(63.0, pd_state())  # the conversion is forgotten: the state's shape counts
    assert (policy.statistics().n_p, policy.statistics().n_d) == (3, 5)


def test_prefill_backlog_converts_a_decode_worker_and_t_rises() -> None:
    policy = roles_policy()
    actions = sustain(policy, pd_state(pd_queue=4), 60)
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


def test_conversion_waits_for_a_full_period() -> None:
    policy = roles_policy()
    actions = sustain(policy, pd_state(decode_queue=6), 59)
    assert not [a for a in actions if isinstance(a, ConvertWorker)]


def test_config_errors_name_the_option() -> None:
    with pytest.raises(PolicyError, match=r"low_watermark must be <= high_watermark=0.4"):
        DynamicConfig(high_watermark=0.4)
    with pytest.raises(PolicyError, match=r"headroom must lie in \[0, 1\), got 1.0"):
        DynamicConfig(headroom=1.0)
    with pytest.raises(PolicyError, match=r"roles.period_s must be a finite number > 0"):
        RoleConfig(period_s=math.inf)
    with pytest.raises(PolicyError, match=r"prfaas_profile must model prefill time .*'cpu'"):
        PrfaasDynamicPolicy(DynamicConfig(prfaas_profile="cpu"))


def test_eq8_out_of_balance_converts_within_two_periods_and_t_is_resolved() -> None:
    """Short requests only (all under t): PD prefill outruns decode by far (Eq. 8), with no
    queue backed up anywhere. On virtual time, the long-term loop converts one PD prefill
    worker to decode at the end of a period, within two, then re-solves t for the new shape."""
    policy = PrfaasDynamicPolicy(DynamicConfig(
        min_samples=20, roles=RoleConfig(period_s=30.0)))
    for i in range(40):  # the recent lengths: 2K to 4K tokens
        policy.decide(RouteInputs(request_id=f"r{i}", total_len=2_000 + 50 * i))
    state = pd_state(n_p=2, n_d=2)
    solves = policy.statistics().solves
    actions: list[object] = []
    for now in range(61):
        actions += policy.tick(float(now), state)
        if any(isinstance(a, ConvertWorker) for a in actions):
            break
    (conversion,) = [a for a in actions if isinstance(a, ConvertWorker)]
    assert now <= 60 and (conversion.from_role, conversion.to_role) == ("prefill", "decode")
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
