"""PrefixStore: held and resumable prefixes, resume equals recompute, folding, LRU eviction."""

from __future__ import annotations

import random
from typing import cast

import anyio
import pytest
import torch
from trio.testing import wait_all_tasks_blocked

from services.cachedir.prefix_tree import ChainError
from services.contract.messages import (
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    CacheReport,
    WorkerReport,
)
from services.contract.prefix import block_hashes_reference
from services.model.cache import RequestCache, StateSnapshot
from services.model.config import family_config
from services.model.generate import block_boundaries, prefill
from services.model.model import HybridLM, build_model
from services.sim.engine import KVSizes, ModeledConfig, VirtualCache
from services.worker.prefix_store import (
    CacheReporter,
    LocalMatch,
    PrefixStore,
    PrefixStoreConfig,
    PrefixStoreError,
    StoreChange,
    prompt_hashes,
)
from tests.prompts import tokens

BLOCK = 64


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return build_model(family_config("kimi-linear", "tiny"), seed=0)


def cached(model: HybridLM, ids: list[int], snapshots: bool = True) -> RequestCache:
    at = block_boundaries(0, len(ids), BLOCK) if snapshots else []
    return prefill(model, ids, snapshot_at=at).cache


def test_prompt_hashes_cover_full_blocks_only() -> None:
    ids = tokens(200)
    assert prompt_hashes(ids, BLOCK) == block_hashes_reference(ids, BLOCK)
    assert len(prompt_hashes(ids, BLOCK)) == 3
    assert prompt_hashes([], BLOCK) == []


def test_store_reports_blocks_and_matches_prefixes(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(200)
    change = store.store(prompt_hashes(ids, BLOCK), cached(model, ids))
    store.check_integrity()
    assert change.stored is not None and change.evicted == []
    assert change.stored.runs == [BlockRun(prompt_hashes(ids, BLOCK), [0, 1, 2])]
    assert store.match(prompt_hashes(ids + tokens(64, 1), BLOCK)) == LocalMatch(3, 3)
    other = ids[:BLOCK] + tokens(BLOCK, 2)
    assert store.match(prompt_hashes(other, BLOCK)) == LocalMatch(1, 1)
    assert store.match(prompt_hashes(tokens(128, 3), BLOCK)) == LocalMatch(0, 0)


def test_resume_then_prefill_equals_full_prefill(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(200)
    store.store(prompt_hashes(ids, BLOCK), cached(model, ids))
    longer = ids[:150] + tokens(70, 4)
    resumed = store.resume(prompt_hashes(longer, BLOCK), max_blocks=(len(longer) - 1) // BLOCK)
    assert resumed is not None and resumed.length == 128
    tail = prefill(model, longer[128:], resumed)
    whole = prefill(model, longer)
    torch.testing.assert_close(tail.logits, whole.logits, rtol=1e-4, atol=1e-4)
    assert store.resume(prompt_hashes(longer, BLOCK), max_blocks=0) is None
    store.check_integrity()


def test_resume_stops_at_the_last_snapshot(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(192)
    cache = prefill(model, ids, snapshot_at=[64]).cache  # no snapshot at 128 (192 is its end)
    store.store(prompt_hashes(ids, BLOCK), cache)
    probe = prompt_hashes(ids[:128] + tokens(64, 5), BLOCK)
    assert store.match(probe) == LocalMatch(2, 1)
    resumed = store.resume(probe, max_blocks=2)
    assert resumed is not None and resumed.length == 64


def test_kv_base_holds_the_prefix_or_says_why(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(130)
    cache = cached(model, ids, snapshots=False)
    store.store(prompt_hashes(ids, BLOCK), cache)
    base = store.kv_base(prompt_hashes(ids, BLOCK), 2)
    assert base is cache and base.length == 130
    with pytest.raises(PrefixStoreError, match="holds no KV for the first 2 blocks"):
        store.kv_base(prompt_hashes(tokens(130, 6), BLOCK), 2)
    with pytest.raises(PrefixStoreError, match="blocks must be in"):
        store.kv_base(prompt_hashes(ids, BLOCK), 3)


def test_an_extension_folds_the_older_entry_and_keeps_its_snapshots(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(140)
    store.store(prompt_hashes(ids, BLOCK), cached(model, ids))
    resumed = store.resume(prompt_hashes(ids, BLOCK), 2)
    assert resumed is not None
    longer = ids + tokens(60, 7)
    prefill(model, longer[128:], resumed)  # no snapshots of its own
    change = store.store(prompt_hashes(longer, BLOCK), resumed)
    store.check_integrity()
    stats = store.statistics()
    assert (stats.entries, stats.folded, stats.blocks) == (1, 1, 3)
    assert change.stored is not None and change.stored.runs[0].snapshot_at == [0, 1]
    assert store.match(prompt_hashes(longer, BLOCK)) == LocalMatch(3, 2)
    report = store.report("pd", "decode")
    assert (report.worker, report.cluster, report.role, len(report.runs)) == (
        "w", "pd", "decode", 1)



def test_a_store_the_directory_already_knows_of_is_not_announced(model: HybridLM) -> None:
    """A hot prefix stored again (every request that reuses it) tells the directory nothing:
    no BlocksStored. A store that adds a block or a snapshot still says so."""
    store = PrefixStore("w", BLOCK)
    ids = tokens(140)
    hashes = prompt_hashes(ids, BLOCK)
    assert store.store(hashes, cached(model, ids)).stored is not None
    again = store.store(hashes, cached(model, ids))
    assert (again.stored, again.evicted) == (None, [])
    store.check_integrity()
    assert store.statistics().entries == 1 and store.match(hashes) == LocalMatch(2, 2)
    # The same blocks with a snapshot the store lacks (a chain stored without snapshots,
    # then again with them): announced, with the new snapshot in the run.
    other = tokens(140, 5)
    bare = prefill(model, other).cache  # no snapshot below its last full block
    first = store.store(prompt_hashes(other, BLOCK), bare)
    assert first.stored is not None and first.stored.runs[0].snapshot_at == []
    second = store.store(prompt_hashes(other, BLOCK), cached(model, other))
    assert second.stored is not None and second.stored.runs[0].snapshot_at == [0, 1]
    longer = ids + tokens(BLOCK, 6)
    grown = store.store(prompt_hashes(longer, BLOCK), cached(model, longer))
    assert grown.stored is not None and len(grown.stored.runs[0].hashes) == 3

def entry_bytes(model: HybridLM, n: int) -> int:
    store = PrefixStore("probe", BLOCK)
    ids = tokens(n, 9)
    store.store(prompt_hashes(ids, BLOCK), cached(model, ids))
    return store.statistics().bytes


def test_a_stored_cache_keeps_its_snapshots(model: HybridLM) -> None:
    """The store reads an entry's snapshot blocks once; a stored cache changed afterwards
    would make its answers stale, and check_integrity says so."""
    store = PrefixStore("w", BLOCK)
    ids = tokens(200)
    cache = cached(model, ids)
    store.store(prompt_hashes(ids, BLOCK), cache)
    store.check_integrity()
    del cache.snapshots[2 * BLOCK]
    with pytest.raises(PrefixStoreError, match="snapshots changed"):
        store.check_integrity()


def test_lru_eviction_within_the_budget(model: HybridLM) -> None:
    size = entry_bytes(model, 128)
    store = PrefixStore("w", BLOCK, PrefixStoreConfig(budget_bytes=2 * size + size // 2))
    a, b, c = tokens(128, 1), tokens(128, 2), tokens(128, 3)
    for ids in (a, b):
        assert store.store(prompt_hashes(ids, BLOCK), cached(model, ids)).evicted == []
    assert store.resume(prompt_hashes(a, BLOCK), 1) is not None  # a is now most recent
    change = store.store(prompt_hashes(c, BLOCK), cached(model, c))
    store.check_integrity()
    assert change.evicted == [BlocksEvicted("w", prompt_hashes(b, BLOCK))]
    assert store.match(prompt_hashes(b, BLOCK)) == LocalMatch(0, 0)
    assert store.match(prompt_hashes(a, BLOCK)) == LocalMatch(2, 2)
    assert store.statistics().evictions == 1


def test_eviction_reports_snapshots_only_for_blocks_still_held(model: HybridLM) -> None:
    size = entry_bytes(model, 128)
    store = PrefixStore("w", BLOCK, PrefixStoreConfig(budget_bytes=size + size // 2))
    x = tokens(128, 1)
    y = x[:BLOCK] + tokens(BLOCK, 2)
    store.store(prompt_hashes(x, BLOCK), cached(model, x))
    change = store.store(prompt_hashes(y, BLOCK), prefill(model, y, snapshot_at=[128]).cache)
    hx, hy = prompt_hashes(x, BLOCK), prompt_hashes(y, BLOCK)
    assert change.evicted == [BlocksEvicted("w", [hx[1]]),
                              BlocksEvicted("w", [hx[0]], snapshots_only=True)]
    assert store.match(hy) == LocalMatch(2, 2)
    assert store.match(hx) == LocalMatch(1, 0)
    store.check_integrity()


def test_an_entry_over_the_whole_budget_is_not_kept(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK, PrefixStoreConfig(budget_bytes=1000))
    ids = tokens(128)
    change = store.store(prompt_hashes(ids, BLOCK), cached(model, ids))
    assert (change.stored, change.evicted) == (None, [])
    assert store.statistics().entries == 0


def test_store_refuses_a_chain_that_does_not_fit_the_cache(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK)
    ids = tokens(130)
    with pytest.raises(PrefixStoreError, match="must name the cache's 2 full blocks, got 1"):
        store.store(prompt_hashes(ids, BLOCK)[:1], cached(model, ids))
    with pytest.raises(PrefixStoreError, match="budget_bytes must be >= 0, got -1"):
        PrefixStoreConfig(budget_bytes=-1)


def test_the_prefix_index_finds_what_a_scan_of_every_entry_finds(model: HybridLM) -> None:
    store = PrefixStore("w", BLOCK, PrefixStoreConfig(budget_bytes=1 << 40))
    shared = tokens(3 * BLOCK, salt=9)
    chains = [shared[:BLOCK], tokens(2 * BLOCK, salt=1), shared[: 2 * BLOCK], tokens(BLOCK, salt=2)]
    for ids in chains:
        store.store(prompt_hashes(ids, BLOCK), cached(model, ids, snapshots=False))
    for ids in [shared, shared[: 2 * BLOCK], tokens(2 * BLOCK, salt=1) + shared, tokens(BLOCK, 5)]:
        hashes = prompt_hashes(ids, BLOCK)
        assert store.prefixes_of(hashes) == store.prefixes_of_reference(hashes)
    # The two-block prefix of `shared` folded the one-block one; it is what `shared` extends.
    assert [e.hashes for e in store.prefixes_of(prompt_hashes(shared, BLOCK))] == [
        tuple(prompt_hashes(shared[: 2 * BLOCK], BLOCK))]


def _chain(path: tuple[int, ...], ids: dict[tuple[int, ...], int]) -> list[int]:
    """A chain whose hash i names the path's first i + 1 steps (as a real chain names its
    prefix): paths sharing k steps share k hashes."""
    return [ids.setdefault(path[: i + 1], len(ids) + 1) for i in range(len(path))]


def _sized_cache(blocks: int, extra: int, snapshots: list[int]) -> RequestCache:
    """The simulation's cache (sizes, no tensors): 1 byte a token, 100 per entry and snapshot."""
    cache = VirtualCache(ModeledConfig(block_size=BLOCK), KVSizes(100, 1.0),
                         blocks * BLOCK + extra)
    for n in snapshots:
        cache.add_snapshot(StateSnapshot(n * BLOCK, ()))
    return cast(RequestCache, cache)


def _held_in(report: WorkerReport) -> tuple[set[int], set[int]]:
    """Every hash the report's runs hold, and those with a snapshot at their block."""
    held = {h for run in report.runs for h in run.hashes}
    snapped = {run.hashes[i] for run in report.runs for i in run.snapshot_at}
    return held, snapped


def _match_by_scan(report: WorkerReport, hashes: list[int]) -> LocalMatch:
    """`match` from the full report: the longest run prefix equal to the chain's, and the
    longest such prefix (within it) ending at a snapshot."""
    held, resumable = 0, 0
    for run in report.runs:
        common = 0
        while common < min(len(run.hashes), len(hashes)) and (
                run.hashes[common] == hashes[common]):
            common += 1
        held = max(held, common)
        resumable = max([resumable, *(i + 1 for i in run.snapshot_at if i < common)])
    return LocalMatch(held, min(resumable, held))


@pytest.mark.parametrize("seed", range(6))
def test_random_stores_keep_the_index_and_the_reports_true(seed: int) -> None:
    """Stores, resumes and lookups of branching chains in a budget a few entries fill: after
    each, the index is the entries' (check_integrity), `match` and `prefixes_of` equal a
    scan, and a store's messages name the blocks and the snapshots the store lost."""
    rng = random.Random(seed)
    store = PrefixStore("w", BLOCK, PrefixStoreConfig(budget_bytes=2600))
    ids: dict[tuple[int, ...], int] = {}
    for _ in range(300):
        path = tuple(rng.randrange(3) for _ in range(rng.randint(1, 6)))
        hashes = _chain(path, ids)
        action = rng.random()
        if action < 0.6:
            before = _held_in(store.report("c", "decode"))
            snapshots = rng.sample(range(1, len(hashes) + 1), min(len(hashes), rng.randint(0, 2)))
            change = store.store(hashes, _sized_cache(len(hashes), rng.choice([0, 5]),
                                                      snapshots))
            after = _held_in(store.report("c", "decode"))
            lost = [h for e in change.evicted if not e.snapshots_only for h in e.hashes]
            lost_snapshots = [h for e in change.evicted if e.snapshots_only for h in e.hashes]
            assert sorted(lost) == sorted(before[0] - after[0])
            # A block whose last snapshot went with one victim may go whole with the next.
            assert set(lost_snapshots) - set(lost) == (before[1] - after[1]) & after[0]
            assert set(lost_snapshots) <= before[1] - after[1]
        elif action < 0.8:
            store.resume(hashes, rng.randint(0, len(hashes)))
        elif store.match(hashes).held:
            store.kv_base(hashes, rng.randint(1, store.match(hashes).held))
        store.check_integrity()
        assert store.match(hashes) == _match_by_scan(store.report("c", "decode"), hashes)
        assert store.prefixes_of(hashes) == store.prefixes_of_reference(hashes)
    stats = store.statistics()
    assert stats.evictions > 20 and stats.folded > 20 and stats.hits > 20
    # A held hash at another block than the asked chain's (a chain made another way) names
    # another prefix: the entry holding it is no prefix of the chain.
    store.store([7001, 7002], _sized_cache(2, 0, []))
    assert store.prefixes_of([7003, 7001]) == store.prefixes_of_reference([7003, 7001]) == []


def change_of(worker: str, first: int, evicted: list[int] | None = None) -> StoreChange:
    stored = BlocksStored(worker, [BlockRun([first, first + 1], [1])])
    return StoreChange(stored, [BlocksEvicted(worker, evicted)] if evicted else [])


@pytest.mark.trio
async def test_a_reporter_handing_over_in_process_keeps_the_cast_order(
        caplog: pytest.LogCaptureFixture) -> None:
    """`hand_over` (the simulation's directory in this event loop): the full report first,
    then every change in order; after it, each change at once as it is submitted (no cast,
    no wait for the reporter's task); a report the directory refuses is logged, not raised."""
    got: list[CacheReport] = []

    def take(report: CacheReport) -> None:
        if isinstance(report, BlocksStored) and report.runs[0].hashes[0] == 66:
            raise ChainError("block 66 reported at depth 0, known at depth 3")
        got.append(report)

    full = WorkerReport("w", "pd", "prefill", [])
    reporter = CacheReporter(None, "cachedir", lambda: full, hand_over=take)  # type: ignore[arg-type]
    reporter.submit(change_of("w", 10))  # before the full report: it covers this one
    async with anyio.create_task_group() as group:
        group.start_soon(reporter.run)
        await wait_all_tasks_blocked()
        assert got == [full]
        change = change_of("w", 20, evicted=[10, 11])
        reporter.submit(change)
        assert got[1:] == [change.stored, *change.evicted]
        reporter.submit(change_of("w", 66))
        reporter.submit(change_of("w", 30))
        assert got[3:] == [change_of("w", 30).stored]
        group.cancel_scope.cancel()
    assert "cache report BlocksStored refused by cachedir: ChainError: block 66" in caplog.text
