"""benchmarks/replay_cachedir.py records a run's cache reports and lookups and replays them:
the directory of this checkout and the same file loaded as a baseline answer alike, with the
directory checked at the end. Its timings are the benchmark's business, not this test's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from services.contract.messages import BlocksStored, PrefixQuery

CHECKOUT = Path(__file__).resolve().parent.parent


def load_replay() -> ModuleType:
    path = CHECKOUT / "benchmarks" / "replay_cachedir.py"
    spec = importlib.util.spec_from_file_location("replay_cachedir", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_recorded_minute_replays_to_equal_answers() -> None:
    bench = load_replay()
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
