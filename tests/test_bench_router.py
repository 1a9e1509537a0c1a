"""`make bench-router` in its quick form: every request succeeds and the JSON line is whole.

Its speed is the benchmark's business (benchmarks/bench_router.py), not this test's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"router_rps", "baseline_rps", "rps_ratio", "added_ms_p50", "added_ms_p99"}


def test_the_quick_bench_serves_every_request_and_prints_its_json_line() -> None:
    done = subprocess.run([sys.executable, "benchmarks/bench_router.py", "--requests", "20",
                           "--scrape-every", "0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.keys() >= KEYS and set(result["kinds"]) == {"plain", "stream"}
    # 20 at concurrency 16 and 5 at concurrency 1, per kind and target; then 5 short ones
    # beside the long prompts, which were sent and answered too.
    long = result["long_prompts"]
    assert long["long_completed"] > 0 and long["long_failed"] == 0
    # The scraped turns: /metrics answered while the same requests ran, and its cost alone.
    scrape = result["scrape"]
    assert scrape["metrics_bytes"] > 0 and scrape["router_cpu_ms_per_scrape"] > 0
    assert all(kind["scrapes"] > 0 for kind in scrape["kinds"].values())
    # The router's scraped turns add 20 at concurrency 16 per kind.
    assert (result["failed"], result["completed"]) == (
        0, 2 * 2 * (20 + 5) + 2 * 20 + 5 + long["long_completed"])
    assert result["router_rps"] > 0 and result["baseline_rps"] > 0
    low, high = result["rps_ratio_spread"]
    assert 0 < low <= high


def test_against_another_tree_takes_turns_and_reports_both_routers_cpu() -> None:
    # This tree against itself: the second router runs from the tree named, in its own
    # process over the same backend, in every round beside this tree's.
    # Tracing off (no OTLP endpoint in the environment): the ratio is also the headline.
    untraced = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "benchmarks/bench_router.py", "--requests", "20",
                           "--rounds", "2", "--long-senders", "0", "--against", str(ROOT),
                           "--ours", str(ROOT), "--count-calls", "40"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=untraced)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    against = result["against"]
    assert against["tree"] == str(ROOT) and against["tracing"] == "off"
    assert against["ours"]["tree"] == str(ROOT)
    assert result["tracing_off_ours"] == against["ours"]["commit"]
    assert result["tracing_off_cpu_ratio"] == against["ratio"] == max(
        kind["ratio"] for kind in against["kinds"].values())
    assert result["tracing_off_cpu_median_ratio"] == against["median_ratio"]
    assert result["cpu"]
    for kind in against["kinds"].values():
        for pair in (kind, kind["at_concurrency_1"]):
            assert pair["router_cpu_ms_per_request"] > 0
            assert pair["against_cpu_ms_per_request"] > 0
            assert len(pair["rounds_ratio"]) == 2 and pair["median_ratio"] > 0
    # Three targets, two kinds: 20 at concurrency 16 and 5 at concurrency 1 each.
    assert (result["failed"], result["completed"]) == (0, 3 * 2 * (20 + 5))
    # Then both routers again under the call counter: the same code makes about as many
    # calls a request (thousands: the loop's work, counted on its thread).
    calls = result["calls"]
    assert result["tracing_off_calls_ratio"] == calls["ratio"] == max(
        kind["ratio"] for kind in calls["kinds"].values())
    for kind in calls["kinds"].values():
        assert kind["router_calls_per_request"] > 1000
        assert kind["ratio"] == pytest.approx(1.0, abs=0.1)
        assert kind["net_of_idle_ratio"] == pytest.approx(1.0, abs=0.1)
    assert calls["router_idle_calls_per_s"] > 0 and calls["against_idle_calls_per_s"] > 0


def test_the_measured_router_runs_from_the_tree_ours_names(tmp_path: Path) -> None:
    # A tree whose `prfaas` exits at once: the run stops there (with this checkout's router
    # in its place it would run to the end).
    broken = tmp_path / "broken"
    (broken / "services" / "cli").mkdir(parents=True)
    for package in ("services", "services/cli"):
        (broken / package / "__init__.py").write_text("")
    (broken / "services" / "cli" / "main.py").write_text("raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "benchmarks/bench_router.py", "--requests", "4",
                           "--rounds", "1", "--long-senders", "0", "--against", str(ROOT),
                           "--ours", str(broken)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "did not start (exit code 3)" in done.stderr
    refused = subprocess.run([sys.executable, "benchmarks/bench_router.py", "--ours", str(ROOT)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--ours is measured against --against" in refused.stderr


def test_against_a_commit_runs_its_files_exported_from_git(tmp_path: Path) -> None:
    bench_router = load_benchmark("bench_router")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    tree, commit = bench_router.against_tree("HEAD", tmp_path)
    assert commit == head and tree == tmp_path / f"against-{head}"
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:services/cli/main.py"],
                               capture_output=True, text=True, check=True).stdout
    assert (tree / "services" / "cli" / "main.py").read_text() == committed
    # A directory is taken as it is (its commit read later, from its checkout).
    assert bench_router.against_tree(str(ROOT), tmp_path) == (ROOT, "")
    with pytest.raises(SystemExit, match="neither a directory nor a commit"):
        bench_router.against_tree("no-such-revision-here", tmp_path)


def test_tracing_off_pools_the_rounds_of_every_run_beside_a_control() -> None:
    tracing_off = load_benchmark("bench_tracing_off")
    runs = [{"against": {"kinds": {"plain": {"rounds_ratio": [1.0, 1.1]},
                                   "stream": {"rounds_ratio": [0.9, 1.3]}}}},
            {"against": {"kinds": {"plain": {"rounds_ratio": [1.2]},
                                   "stream": {"rounds_ratio": [1.2]}}}}]
    rounds = tracing_off.pooled(runs)
    assert rounds == {"plain": [1.0, 1.1, 1.2], "stream": [0.9, 1.3, 1.2]}
    measured = tracing_off.summary(rounds)
    # The worse kind's median is the headline; its interval holds it.
    assert measured["ratio"] == 1.2 and measured["kinds"]["plain"]["median"] == 1.1
    low, high = measured["interval"]
    assert 0.9 <= low <= 1.2 <= high <= 1.3
    assert tracing_off.median_interval([1.0] * 9) == (1.0, 1.0, 1.0)


def test_tracing_off_runs_the_change_and_the_control_and_prints_one_json_line() -> None:
    # HEAD against HEAD both ways: a smoke run (the numbers are the host's noise).
    done = subprocess.run([sys.executable, "benchmarks/bench_tracing_off.py", "--runs", "1",
                           "--rounds", "2", "--requests", "8", "--count-calls", "0",
                           "--count-instructions", "0",
                           "--merge", "HEAD", "--parent", "HEAD"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert [line.startswith("run 1/1: HEAD against HEAD") for line in lines[:2]] == [True, True]
    result = json.loads(lines[-1])
    assert {"tracing_off_cpu_ratio", "tracing_off_cpu_interval", "control_cpu_ratio",
            "control_cpu_interval", "cpu"} <= set(result)
    assert len(result["rounds"]["change"]) == 2 and result["tracing_off_cpu_ratio"] > 0


def test_a_pair_takes_turns_back_to_back_each_side_first_as_often() -> None:
    bench_router = load_benchmark("bench_router")
    targets = ["router", "baseline", "against"]
    assert bench_router.turn_order(targets, False, 0) == ["router", "against", "baseline"]
    assert bench_router.turn_order(targets, False, 1) == ["against", "router", "baseline"]
    assert bench_router.turn_order(["router", "baseline"], True, 1) == [
        "scraped", "router", "baseline"]
    assert bench_router.turn_order(["router", "baseline"], False, 1) == ["router", "baseline"]


WORKER = """
import sys
for line in sys.stdin:
    print(sum(i * i for i in range(int(line))), flush=True)
"""


def test_the_instruction_counter_counts_the_work_done_while_it_counts(tmp_path: Path) -> None:
    # A process under callgrind that does a fixed piece of work per line it reads: twice the
    # lines, twice the instructions, and the same lines again, the same count.
    bench_router = load_benchmark("bench_router")
    counter = bench_router.InstructionCounter()
    argv = [*counter.start(tmp_path / "worker.out")[:-1], "-c", WORKER]  # python -c, not -m
    assert argv[0] == "valgrind"
    worker = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    assert worker.stdin is not None and worker.stdout is not None

    async def lines(count: int) -> list[str]:
        answers = []
        for _ in range(count):
            worker.stdin.write("20000\n")  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
            answers.append(await asyncio.to_thread(worker.stdout.readline))  # type: ignore[union-attr]
        return answers

    async def counts() -> list[float]:
        await lines(1)  # started: the interpreter is up and reading
        found = []
        for count in (10, 20, 10):
            answers, instructions = await counter.count(0, worker.pid, tmp_path / "x",
                                                        lines(count))
            assert len(answers) == count and answers[0].strip() == str(
                sum(i * i for i in range(20000)))
            found.append(instructions)
        return found

    with worker:
        try:
            ten, twenty, again = asyncio.run(counts())
        finally:
            worker.kill()
    assert ten > 20 * 20000  # a few instructions per loop step at least
    assert twenty / ten == pytest.approx(2.0, rel=0.05)
    assert again == pytest.approx(ten, rel=0.02)
