"""services.chaos: one quick scenario against the real mesh (kill -9 of the decode worker)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.chaos.cli import chaos_main, exit_status
from services.chaos.faults import envelope_frames, malformed_bodies, random_frames
from services.chaos.harness import MeshConfig, chaos_topology
from services.chaos.load import LOAD_OCCUPANCY, OUTCOMES, Result, sized_rate
from services.chaos.report import migration_cost, verdict
from services.chaos.scenarios import ScenarioResult, migrations_of

pytestmark = pytest.mark.slow


def test_frames_and_bodies_are_as_many_as_asked() -> None:
    rng = random.Random(0)
    assert len(random_frames(rng, 50)) == 50
    assert len(envelope_frames(30, rng, pool=10)) == 30
    assert len(malformed_bodies(rng, 40)) == 40


@pytest.mark.timeout(400)
def test_quick_kill_decode_is_measured_and_the_worker_comes_back(tmp_path: Path) -> None:
    out = tmp_path / "reliability.md"
    status = chaos_main(["--quick", "--only", "kill-decode", "--out", str(out),
                         "--workdir", str(tmp_path / "mesh")])
    report = out.read_text()
    assert "### kill-decode:" in report
    # The exit status is the verdict: 0 when the scenario passed, 1 (report still written)
    # when it failed.
    assert status == (0 if "### kill-decode: PASS" in report else 1)
    row = next(line for line in report.splitlines() if line.startswith("| kill-decode |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    sent, outcomes = int(cells[2]), [int(c) for c in cells[3:7]]
    # Every request sorted into exactly one outcome; the decode worker died once, by our
    # hand, and was back and serving (a probe completed) within the limit.
    assert sent > 0 and sum(outcomes) == sent and len(outcomes) == len(OUTCOMES)
    assert cells[8] != "never"  # the migrated count is cells[7]
    assert "| 1 / 0 |" in report


def test_the_chaos_mesh_gives_every_worker_the_small_cache_budget() -> None:
    data = chaos_topology(MeshConfig(cache_mib=24.0))
    workers = [s for s in data["services"] if s["kind"] in ("prefill", "decode")]
    clusters = {c["name"]: c["options"] for c in data["clusters"]}
    assert workers and all(
        {**clusters[s["cluster"]], **s.get("options", {})}["cache_mib"] == 24.0 for s in workers)


def test_the_exit_status_is_the_verdict() -> None:
    def result(**outcomes: int) -> ScenarioResult:
        rss = {"router": 100 << 20}
        return ScenarioResult(name="x", description="x", sent=sum(outcomes.values()),
                              outcomes=outcomes, statuses={}, killed=(), deaths={},
                              rss_start=rss, rss_peak=rss, rss_after=rss, recover_s=1.0)

    good, hung = result(completed=10), result(completed=9, hung=1)
    assert verdict(good).passed and not verdict(hung).passed
    assert exit_status([good, good]) == 0
    assert exit_status([good, hung]) == 1


def test_fault_scenarios_may_not_answer_errors_and_migrations_are_read_and_costed() -> None:
    def result(name: str, **outcomes: int) -> ScenarioResult:
        rss = {"router": 100 << 20}
        return ScenarioResult(name=name, description="x", sent=sum(outcomes.values()),
                              outcomes=outcomes, statuses={}, killed=(), deaths={},
                              rss_start=rss, rss_peak=rss, rss_after=rss, recover_s=1.0,
                              migrations={"decode_lost": 2}, resume_s=0.5)

    assert not verdict(result("link-trickle", completed=9, error=1)).passed
    assert verdict(result("overload-3x", completed=4, error=8)).passed
    before = migrations_of('prfaas_router_migrations_total{reason="decode_lost"} 1.0\n'
                           "prfaas_router_migrations_resumed_total 1.0\n"
                           "prfaas_router_migration_resume_seconds_total 0.25\n")
    after = migrations_of('prfaas_router_migrations_total{reason="decode_lost"} 3.0\n'
                          'prfaas_router_migrations_total{reason="kv_stalled"} 0.0\n'
                          "prfaas_router_migrations_resumed_total 3.0\n"
                          "prfaas_router_migration_resume_seconds_total 1.25\n")
    assert after.since(before) == ({"decode_lost": 2}, 0.5)
    cost = "\n".join(migration_cost([result("kill-decode", completed=10)]))
    assert "migrated 2 requests" in cost and "averaged 0.5 s" in cost


def test_the_background_load_is_sized_to_the_hosts_measured_latency() -> None:
    def done(latency: float, outcome: str = "completed") -> Result:
        return Result(outcome=outcome, status=200, sent=10.0, admitted=10.1,  # type: ignore[arg-type]
                      done=10.0 + latency)
    # 2 s answers at an admission limit of 4: 0.3 x 4 / 2 = 0.6 req/s keeps 1.2 in flight.
    slow = [done(1.5), done(2.5), done(30.0, "hung")]
    assert sized_rate(slow, 4, ceiling=4.0) == pytest.approx(LOAD_OCCUPANCY * 4 / 2.0)
    # A fast host is held at the configured rate, a hopeless one at the floor.
    assert sized_rate([done(0.05)], 4, ceiling=4.0) == 4.0
    assert sized_rate([done(100.0)], 4, ceiling=4.0) == 0.25
    with pytest.raises(ValueError, match="no completed request"):
        sized_rate([done(1.0, "error")], 4, ceiling=4.0)
