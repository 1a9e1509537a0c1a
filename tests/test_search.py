"""`prfaas search` (services/sim/search/) on a tiny space whose answer is known by construction,
run on one local Ray instance with 2 CPUs (shared by the module's tests: Ray takes seconds to
start) and in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mesh.errors import ConfigError
from services.cli.search import search_main
from services.paper.case_study import DECODE_STEP_S
from services.sim.capacity import SeedCapacity
from services.sim.search.explorer import Summary, frontier, run_search
from services.sim.search.pool import RayPool, SerialPool
from services.sim.search.space import SearchSpace, configurations, load_space
from tests.constant_profile import constant_profile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def space_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two homogeneous deployments of one prefill and one decode instance: `slow` (2 s a
    prefill, $1 an instance-hour) serves 0.5 req/s for $2/h, `fast` (1 s, $3) 1.0 req/s for
    $6/h. So `slow` is the best per dollar, `fast` the most capable, both are on the frontier,
    and the best for $2/h is `slow`, for $6/h `fast`."""
    folder = tmp_path_factory.mktemp("space")
    text = ['name = "tiny"', 'description = "two chips, known answers"', ""]
    for name, seconds, price in (("slow", 2.0, 1.0), ("fast", 1.0, 3.0)):
        path = folder / f"{name}.toml"
        path.write_text(constant_profile(seconds))
        text += [f"[chips.{name}]", f'profile = "{path}"', f"price_per_hour = {price}", ""]
    for name in ("slow", "fast"):
        text += ["[[families]]", f'name = "{name}"', 'kind = "homogeneous"',
                 f'pd_chip = "{name}"', "n_p = [1]", "n_d = [1]", ""]
    text += ["[workload]", "window_s = 60.0", "output_len = 2", "paper_len = 1000", "",
             "[capacity]", "seeds = [0, 1]", "resolution_rps = 0.1", ""]
    path = folder / "tiny.toml"
    path.write_text("\n".join(text))
    return path


@pytest.fixture(scope="module")
def space(space_file: Path) -> SearchSpace:
    return load_space(space_file)


@pytest.fixture(scope="module")
def ray_pool() -> Iterator[RayPool]:
    with RayPool(cpus=2) as pool:
        yield pool


@pytest.fixture(scope="module")
def serial_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serial")


@pytest.fixture(scope="module")
def serial(space: SearchSpace, serial_dir: Path) -> Summary:
    with SerialPool() as pool:
        return run_search(space, serial_dir, pool)


def results(summary: Summary) -> list[Any]:
    """What a search found, without how long it took or where it ran."""
    found: list[Any] = msgspec.to_builtins(msgspec.structs.replace(summary, wall_s=0.0, ray={},
                                                                   computed=0))
    return found


class CountingPool:
    """A pool that counts the jobs it is given and can stop after `stop_after` of them."""

    def __init__(self, inner: RayPool, stop_after: int | None = None) -> None:
        self.inner, self.stop_after = inner, stop_after
        self.address, self.cpus = inner.address, inner.cpus
        self.jobs = 0

    def unordered(self, jobs: Sequence[Callable[[], SeedCapacity]],
                  started: Callable[[int], None]) -> Iterator[tuple[int, SeedCapacity]]:
        self.jobs += len(jobs)
        for done, item in enumerate(self.inner.unordered(jobs, started), start=1):
            yield item
            if self.stop_after is not None and done >= self.stop_after:
                raise KeyboardInterrupt


def test_ray_finds_the_known_best_and_equals_the_serial_search(
        space: SearchSpace, ray_pool: RayPool, serial: Summary, tmp_path: Path) -> None:
    found = run_search(space, tmp_path, ray_pool)
    assert found.ray == {"address": "local", "cpus": 2}
    by_key = {e.key: e for e in found.configurations}
    slow, fast = by_key["slow-0-1-1"], by_key["fast-0-1-1"]
    assert 0.5 - 0.1 <= slow.capacity_rps <= 0.5 and 1.0 - 0.1 <= fast.capacity_rps <= 1.0
    assert (slow.cost_per_hour, fast.cost_per_hour) == (2.0, 6.0)
    assert slow.planner_lambda_rps == pytest.approx(0.5)
    assert found.best_per_dollar == "slow-0-1-1"
    assert found.frontier == ["slow-0-1-1", "fast-0-1-1"]
    assert [(b.budget_per_hour, b.key) for b in found.best_per_budget] == [
        (2.0, "slow-0-1-1"), (6.0, "fast-0-1-1")]
    assert results(found) == results(serial)
    assert msgspec.json.decode((tmp_path / "summary.json").read_bytes())["frontier"] == \
        found.frontier


def test_an_interrupted_search_resumes_without_recomputing(
        space: SearchSpace, ray_pool: RayPool, serial: Summary, tmp_path: Path) -> None:
    seeds = len(space.capacity.seeds)
    # Stopped once the first configuration's seeds are in (both searches run at once on 2
    # CPUs, so at most one more seed's result is lost with the stop).
    first = CountingPool(ray_pool, stop_after=seeds)
    with pytest.raises(KeyboardInterrupt):
        run_search(space, tmp_path, first)
    assert len(list((tmp_path / "configurations").glob("*.msgpack"))) == 1
    again = CountingPool(ray_pool)
    resumed = run_search(space, tmp_path, again)
    assert again.jobs == seeds and resumed.computed == 1
    assert results(resumed) == results(serial)
    last = CountingPool(ray_pool)
    assert run_search(space, tmp_path, last).computed == 0 and last.jobs == 0


def test_a_changed_space_recomputes_what_changed(space: SearchSpace, tmp_path: Path,
                                                  serial: Summary) -> None:
    """A stored result is reused only for the same deployment, workload and search."""
    config = configurations(space)[0]
    other = msgspec.structs.replace(space.capacity, resolution_rps=0.2)
    assert config.fingerprint(space.workload, space.capacity) != config.fingerprint(
        space.workload, other)


def test_the_frontier_keeps_only_what_nothing_cheaper_beats(serial: Summary) -> None:
    slow, fast = serial.configurations
    worse = msgspec.structs.replace(fast, key="worse", capacity_rps=0.4, cost_per_hour=3.0)
    tie = msgspec.structs.replace(fast, key="tie", capacity_rps=1.2, cost_per_hour=6.0)
    assert frontier([fast, worse, slow, tie]) == ["slow-0-1-1", "tie"]


def test_the_shipped_searches_load_and_price_the_paper_at_equal_cost() -> None:
    root = Path(__file__).parent.parent / "services" / "sim" / "searches"
    equal = load_space(root / "paper-equal-cost.toml")
    configs = {c.family: c for c in configurations(equal)}
    assert configs["prfaas-pd"].cost_per_hour == configs["homogeneous"].cost_per_hour
    assert configs["prfaas-pd"].deployment.n_prfaas == 4
    assert configs["homogeneous"].deployment.n_prfaas == 0
    assert configs["homogeneous"].planner.lambda_rps == pytest.approx(
        2.11 * 16 / 12, rel=0.05)
    assert configs["prfaas-pd"].planner.lambda_rps == pytest.approx(3.24, rel=0.01)
    bandwidth = configurations(load_space(root / "bandwidth.toml"))
    assert {c.bandwidth_gbps for c in bandwidth} >= {100.0, 5.0}
    # Both state issue 30's SLO: a P90 TTFT bound beside the paper's decode SLO.
    for name in ("paper-equal-cost", "bandwidth"):
        slo = load_space(root / f"{name}.toml").capacity.slo
        assert slo.ttft_p90_s == 15.0 and slo.tpot_s == pytest.approx(DECODE_STEP_S * 1.05)


def test_a_bad_space_names_the_file_and_the_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\n[chips.a]\nprofile = "h20"\nprice_per_hour = 1\n'
                    '[[families]]\nname = "f"\nkind = "homogeneous"\npd_chip = "b"\n'
                    'n_d = [1]\n')
    with pytest.raises(ConfigError, match=r"bad\.toml.*'b'"):
        load_space(path)


def test_the_command_resumes_a_finished_search_and_writes_its_report(
        space_file: Path, serial_dir: Path, serial: Summary,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert search_main(["--config", str(space_file), "--out", str(serial_dir), "--serial",
                        "--no-progress"]) == 0
    summary = msgspec.json.decode((serial_dir / "summary.json").read_bytes())
    assert summary["computed"] == 0 and summary["ray"] == {"address": "serial", "cpus": 1}
    assert [e["capacity_rps"] for e in summary["configurations"]] == [
        e.capacity_rps for e in serial.configurations]
    assert {"frontier.png", "capacity_vs_t.png", "planner_vs_sim.png"} <= {
        p.name for p in serial_dir.glob("*.png")}
    assert "Best capacity per dollar: `slow-0-1-1`" in capsys.readouterr().out
    table = (serial_dir / "table.md").read_text()
    assert "SLO: P99 queueing before prefill <= 5 s" in table and "P90 TTFT there" in table


def test_the_command_refuses_a_bad_space_with_its_name(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\n')
    assert search_main(["--config", str(path), "--out", str(tmp_path / "out"), "--serial"]) == 2
    assert "bad.toml" in capsys.readouterr().err
