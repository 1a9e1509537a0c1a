"""Worker choice: cache-affine first, a load cap on affinity, then least loaded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.router.placement import (
    PlacementConfig,
    PlacementError,
    choose_decode_worker,
    choose_prefill_worker,
    choose_worker,
    choose_worker_reference,
)
from services.router.policy import PolicyError, WorkerSnapshot


def decode(name: str, cached: int = 0, running: int = 0, queue: int = 0,
           capacity: int | None = None) -> WorkerSnapshot:
    return WorkerSnapshot(name=name, kind="pd", role="decode", cached_prefix_tokens=cached,
                          running=running, queue=queue, capacity=capacity)


def test_longest_cached_prefix_wins() -> None:
    workers = [decode("d0", cached=0), decode("d1", cached=2048, running=2), decode("d2", 1024)]
    assert choose_decode_worker(workers) == "d1"


def test_ties_go_to_the_least_loaded_then_by_name() -> None:
    workers = [decode("d2", 512, running=3), decode("d1", 512, running=1, queue=1),
               decode("d0", 512, running=2)]
    assert choose_decode_worker(workers) == "d0"  # d0 and d1 both carry 2: by name
    assert choose_decode_worker([decode("a"), decode("b", running=1)]) == "a"


def test_load_cap_stops_affinity_piling_onto_one_worker() -> None:
    hot = decode("hot", cached=4096, running=6)
    idle = decode("idle", cached=0, running=1)
    # 6 > 1 + 4: over the cap, so the least loaded wins despite the cache.
    assert choose_decode_worker([hot, idle]) == "idle"
    assert choose_decode_worker([hot, idle], PlacementConfig(max_affinity_excess=5)) == "hot"


def test_full_workers_are_skipped_unless_all_are_full() -> None:
    full = decode("full", cached=4096, running=20, capacity=20)
    assert choose_decode_worker([full, decode("open", running=19, capacity=20)]) == "open"
    assert choose_decode_worker([full, decode("also", running=25, capacity=20)]) == "full"


def test_roles_are_respected_and_draining_workers_take_nothing() -> None:
    workers = [
        WorkerSnapshot(name="p0", kind="pd", role="prefill", cached_prefix_tokens=8192),
        WorkerSnapshot(name="drain", kind="pd", role="draining", cached_prefix_tokens=9999),
        decode("d0"),
    ]
    assert choose_decode_worker(workers) == "d0"
    assert choose_prefill_worker(workers) == "p0"
    with pytest.raises(PlacementError, match=r"no decode worker among candidates: p0 \(prefill"):
        choose_decode_worker(workers[:2])
    with pytest.raises(PlacementError, match="candidates: none"):
        choose_prefill_worker([])
    with pytest.raises(PolicyError, match="max_affinity_excess must be >= 0, got -1"):
        PlacementConfig(max_affinity_excess=-1)


worker_lists = st.lists(
    st.builds(
        WorkerSnapshot,
        kind=st.just("pd"),
        name=st.sampled_from(["a", "b", "c", "d", "e"]),
        role=st.sampled_from(["prefill", "decode", "draining"]),
        cached_prefix_tokens=st.sampled_from([0, 512, 1024, 4096]),
        running=st.integers(0, 8),
        queue=st.integers(0, 4),
        capacity=st.sampled_from([None, 4, 10]),
    ),
    min_size=1, max_size=5, unique_by=lambda w: w.name,
)


@given(worker_lists, st.sampled_from(["prefill", "decode"]), st.integers(0, 6))
def test_one_pass_choice_equals_the_reference(workers: list[WorkerSnapshot], role: str,
                                              excess: int) -> None:
    config = PlacementConfig(max_affinity_excess=excess)
    if not any(w.role == role for w in workers):
        with pytest.raises(PlacementError):
            choose_worker(workers, role, config)  # type: ignore[arg-type]
        return
    chosen = choose_worker(workers, role, config)  # type: ignore[arg-type]
    assert chosen == choose_worker_reference(workers, role, config)  # type: ignore[arg-type]
    picked = next(w for w in workers if w.name == chosen and w.role == role)
    open_loads = [w.load for w in workers if w.role == role and not w.full]
    if open_loads:
        assert not picked.full
        assert picked.load <= min(open_loads) + excess
