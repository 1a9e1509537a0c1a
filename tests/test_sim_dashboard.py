"""The dashboard on the simulation: the paced clock, the live load, the server the CLI wires,
the recording of replays, and the entry point that lets services reach ui without importing it."""

from __future__ import annotations

import re
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import trio
import trio.testing
from ui_fixtures.sim import SMALL, conversations, paced_client

from mesh.errors import ConfigError
from services.cli import sim_dashboard
from services.cli.main import COMMANDS
from services.contract import events as t
from services.router.policies import POLICIES
from services.sim.clock import PacedClock
from services.sim.compare import COMPARE_DEFAULT_RATE, CompareSim, compare_deployments
from services.sim.live import MEDIAN_PAPER_TOKENS, LiveConfig, LiveLoad, LiveSim
from ui.errors import UiConfigError
from ui.replay import read_log
from ui.serve import serve_dashboard

ROOT = Path(__file__).resolve().parents[1]


# The paced clock.


def test_paced_clock_fires_timers_on_time_and_stands_still_while_busy() -> None:
    clock = PacedClock(200.0)
    seen: list[float] = []

    async def main() -> None:
        began = time.perf_counter()
        await trio.sleep(2.0)  # 10 ms of wall time at 200x
        seen.append(trio.current_time())
        seen.append(time.perf_counter() - began)
        time.sleep(0.05)  # the loop works for 50 ms: 10 s at 200x, yet no virtual time passes
        seen.append(trio.current_time())
        clock.rate = 1000.0
        await trio.sleep(5.0)
        seen.append(trio.current_time())

    trio.run(main, clock=clock)
    assert seen[0] == 2.0 and seen[2] == 2.0 and seen[3] == 7.0  # exactly, never late
    assert 0.009 <= seen[1] < 1.0  # it waited: paced, not jumped
    stats = clock.statistics()
    assert stats.rate == 1000.0 and 7.0 <= stats.virtual_s < 8.0 and 0 < stats.achieved < 200
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="rate must be a number in"):
            clock.rate = bad


def test_paced_clock_lets_io_in_between_deadlines() -> None:
    """A wake-up that is not a timer (another task's I/O) reads the time paced so far."""
    clock = PacedClock(100.0)
    woke: list[float] = []

    async def main() -> None:
        send, receive = trio.open_memory_channel[None](1)

        async def poke() -> None:
            # A thread stands for the outside world (a browser) waking the loop by I/O.
            await trio.to_thread.run_sync(time.sleep, 0.05)
            await send.send(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poke)
            with trio.move_on_after(3600.0):
                await receive.receive()
                woke.append(trio.current_time())

    trio.run(main, clock=clock)
    # 50 ms of wall time at 100x: about 5 virtual seconds (a loaded host adds some).
    assert len(woke) == 1 and 4.0 <= woke[0] < 3600.0


# The live load.


@pytest.mark.trio
async def test_live_load_follows_its_rate_and_kind(autojump_clock: trio.testing.MockClock) -> None:
    sim = LiveSim(SMALL, config=LiveConfig(output_len=8))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(sim.run, lambda event: None)
        while sim.load is None:
            await anyio.sleep(0.1)
        load: LiveLoad = sim.load
        await anyio.sleep(30.0)
        assert load.statistics().sent == 0 and not load.running  # rate 0: no load
        load.start(2.0, "short")
        await anyio.sleep(50.0)
        sent = load.statistics().sent
        assert 60 <= sent <= 140  # Poisson at 2/s over 50 s
        assert all(load.arrival().paper_len < MEDIAN_PAPER_TOKENS for _ in range(50))
        load.start(2.0, "long")
        assert all(load.arrival().paper_len >= MEDIAN_PAPER_TOKENS for _ in range(50))
        load.stop()
        await anyio.sleep(30.0)
        stats = load.statistics()
        assert stats.sent <= sent + 1 and stats.completed + stats.failed <= stats.sent
        assert stats.completed > 0
        with pytest.raises(ConfigError, match="kind must be one of"):
            load.start(1.0, "huge")
        with pytest.raises(ConfigError, match="rate must be within"):
            load.start(0.0)
        tasks.cancel_scope.cancel()


# The server the CLI runs: the dashboard on a paced simulation, over real HTTP.


@pytest.fixture
def paced_clock() -> PacedClock:
    return PacedClock(50.0)


@asynccontextmanager
async def dashboard_client(
    serve: Callable[..., Awaitable[None]], sim: LiveSim | CompareSim,
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """One of sim_dashboard's servers of `sim` on a free loopback port: a client of it and its
    page; leaving the block stops the server."""
    async with anyio.create_task_group() as tasks:
        host, port = await tasks.start(
            lambda task_status: serve(
                sim, "127.0.0.1", 0, server=serve_dashboard, task_status=task_status))
        async with paced_client(host, port) as client:
            yield client, (await client.get("/")).text
        tasks.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_sim_dashboard_serves_the_simulation_and_its_speed(
    paced_clock: PacedClock,
) -> None:
    sim = LiveSim(SMALL, arrivals=conversations(120.0, rate=1.0), clock=paced_clock)
    async with dashboard_client(sim_dashboard.serve_sim_dashboard, sim) as (client, page):
        assert f'data-policies="{",".join(POLICIES)}"' in page
        with anyio.fail_after(600):  # virtual seconds: 12 of wall time
            while not (await client.get("/api/snapshot")).json()["decisions"]:
                await anyio.sleep(1.0)
        snapshot = (await client.get("/api/snapshot")).json()
        assert snapshot["mode"] == "simulated" and snapshot["config"]["title"].endswith(
            "(small)")
        # Events carry times of day (virtual time from the start, as a clock would say).
        assert abs(snapshot["decisions"][0]["ts"] - time.time()) < 3600
        state = (await client.get("/api/control/state")).json()
        assert state["sim"]["speed"] == 50 and state["router"]["policies"] == list(POLICIES)
        # The page hands its CSRF token to its scripts; POSTs send it back (ui/guard.py).
        client.headers["x-csrf-token"] = await csrf_token(client)
        faster = await client.post("/api/control/speed", json={"speed": 200})
        assert faster.json()["speed"] == 200 and paced_clock.rate == 200
        # Replays wait wall seconds, though this loop's clock runs 200 times faster.
        started = await client.post("/api/replay", json={"action": "play",
                                                          "name": "sample.jsonl"})
        assert started.json()["state"] == "playing"
        began = time.perf_counter()
        await anyio.sleep(200.0)  # one wall second
        position = (await client.get("/api/replay")).json()["status"]["position_s"]
        assert 0 < position <= time.perf_counter() - began + 0.5


def test_dashboard_options_are_checked_by_the_dashboard() -> None:
    options = sim_dashboard.dashboard_options(SMALL)
    assert options["live_mode"] == "simulated" and options["policies"] == list(POLICIES)

    async def serve_bad() -> None:
        await serve_dashboard("127.0.0.1", 0, LiveSim(SMALL), None,  # type: ignore[arg-type]
                              options={"max_flows": 0})

    with pytest.raises(UiConfigError, match=r"dashboard options: .*max_flows"):
        anyio.run(serve_bad, backend="trio")


# The CLI: the entry point, the command, the recording.


def test_the_dashboard_server_is_found_through_its_declared_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = project["project"]["entry-points"][sim_dashboard.DASHBOARD_GROUP]["serve"]
    module, name = value.split(":")
    assert (module, name) == ("ui.serve", "serve_dashboard")
    assert "sim-dashboard" in COMMANDS
    monkeypatch.setattr(sim_dashboard, "entry_points", lambda **kw: [])
    with pytest.raises(ConfigError, match=r"prfaas\.dashboard:serve is not installed"):
        sim_dashboard.dashboard_server()


def test_record_writes_a_replay_of_the_simulated_deployment(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    argv = ["--record", str(out), "--seconds", "20", "--rate", "1", "--output-len", "16"]
    assert sim_dashboard.sim_dashboard_main(argv) == 0
    events = read_log(out)
    assert events[0].ts >= 0 and events[-1].ts <= 20.0
    assert [e.ts for e in events] == sorted(e.ts for e in events)
    assert len({e.worker for e in events if isinstance(e, t.WorkerStatus)}) == 12
    assert {t.RoutingDecision, t.LinkStats, t.WorkerStatus, t.RequestPhase} <= {
        type(e) for e in events}
    assert sim_dashboard.sim_dashboard_main(["--record", str(out), "--rate", "-1"]) == 2


async def csrf_token(client: httpx.AsyncClient) -> str:
    page = (await client.get("/")).text
    found = re.search(r'<meta name="csrf-token" content="([^"]+)">', page)
    assert found is not None
    return found.group(1)


# The compare page's server (its browser test is tests/test_ui_compare.py).


@pytest.mark.trio
async def test_the_compare_dashboard_serves_a_hub_per_deployment_and_shared_controls(
    paced_clock: PacedClock,
) -> None:
    deployments = compare_deployments(["prfaas-pd", "homogeneous"])
    sim = CompareSim(deployments, config=LiveConfig(rate=2.5), clock=paced_clock)
    async with dashboard_client(sim_dashboard.serve_compare_dashboard, sim) as (client, page):
        assert 'data-testid="column-prfaas-pd"' in page
        assert 'data-testid="column-homogeneous"' in page
        assert "PrfaaS-PD vs homogeneous PD" in page
        with anyio.fail_after(600):  # virtual seconds
            while not all((await client.get("/api/compare?after=-1")).json()[
                    "samples"].values()):
                await anyio.sleep(1.0)
        polled = (await client.get("/api/compare?after=5")).json()
        assert all(s["at"] > 5 for samples in polled["samples"].values() for s in samples)
        assert polled["speed"] == 50 and polled["load"]["rate"] == 2.5
        assert (await client.get("/api/compare?after=x")).status_code == 400
        for name in deployments:
            snapshot = (await client.get(f"/d/{name}/api/snapshot")).json()
            assert snapshot["mode"] == "simulated" and len(snapshot["workers"]) == 12
        stats = (await client.get("/api/stats")).json()
        assert set(stats) == set(deployments)
        client.headers["x-csrf-token"] = await csrf_token(client)
        rerated = await client.post("/api/control/workload",
                                    json={"action": "start", "rate": 3.0})
        assert rerated.json()["workload"]["rate"] == 3.0 and sim.load is not None
        assert sim.load.rate == 3.0
        faster = await client.post("/api/control/speed", json={"speed": 100})
        assert faster.json()["speed"] == 100 and paced_clock.rate == 100
        refused = await client.post("/api/control/policy", json={"policy": "homogeneous"})
        assert refused.status_code == 404  # the compare page offers no policy control


def test_compare_cli_refuses_bad_names_and_recording(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_dashboard.sim_dashboard_main(["--compare", "prfaas-pd"]) == 2
    assert "two or three distinct names" in capsys.readouterr().err
    argv = ["--compare", "prfaas-pd,homogeneous", "--record", str(tmp_path / "x.jsonl")]
    assert sim_dashboard.sim_dashboard_main(argv) == 2
    assert "--record and --compare" in capsys.readouterr().err
    args = sim_dashboard._parser().parse_args(["--compare", "prfaas-pd,homogeneous,naive"])
    sim = sim_dashboard.compare_sim(args)
    assert [c.name for c in sim.columns] == ["prfaas-pd", "homogeneous", "naive"]
    assert sim.config.rate == COMPARE_DEFAULT_RATE
