"""benchmarks/replay_cachedir.py records a run's cache reports and lookups and replays them:
the directory of this checkout and the same file loaded as a baseline answer alike, with the
directory checked at the end. Its timings are the benchmark's business, not this test's."""

from __future__ import annotations

from services.contract.messages import BlocksStored, PrefixQuery
from tests.benchmark_scripts import CHECKOUT, load_benchmark


def test_a_recorded_minute_replays_to_equal_answers() -> None:
    bench = load_benchmark("replay_cachedir")
    recording = bench.record(60.0)
    kinds = {type(item) for item in recording.stream}
    assert {BlocksStored, PrefixQuery} <= kinds
    assert len(recording.workers) == 12
    ours: list[object] = []
    theirs: list[object] = []
    seconds = bench.replay(bench.service, recording, ours)
    bench.replay(bench.load_baseline(CHECKOUT), recording, theirs)
    assert set(seconds) == set(bench.KINDS)
    assert len(ours) == len(recording.stream) + 1
    assert ours == theirs
