"""Tests for services.cachedir.directory: the CacheDirectory against a slow, obvious model."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.cachedir.directory import CacheDirectory, CacheDirectoryStatistics
from services.cachedir.prefix_tree import ChainError
from services.contract.errors import UnknownWorkerError
from services.contract.messages import (
    BlockRun,
    BlocksStored,
    ClusterMatch,
    PrefixMatch,
    TransferPlan,
    WorkerMatch,
    WorkerReport,
)
from services.contract.prefix import MAX_HASH, chain_from_ids
from services.contract.types import Role


def _universe(n_nodes: int, seed: int) -> tuple[list[int | None], list[list[int]]]:
    """A fixed random tree of block hashes: parent of each node and the chain ending at it."""
    rng = random.Random(seed)
    hashes = [1000 + i for i in range(n_nodes)]
    parents: list[int | None] = []
    paths: list[list[int]] = []
    for index, block in enumerate(hashes):
        # Mostly extend the last node, so chains get deep; sometimes branch or start a root.
        draw = rng.random()
        above = index - 1 if draw < 0.6 else rng.randrange(index) if draw < 0.9 else None
        above = None if index == 0 else above
        parents.append(None if above is None else hashes[above])
        paths.append(([] if above is None else paths[above]) + [block])
    return parents, paths


PARENTS, PATHS = _universe(30, seed=11)
HASHES = [path[-1] for path in PATHS]
DEPTH = {path[-1]: len(path) - 1 for path in PATHS}
PARENT_OF = dict(zip(HASHES, PARENTS, strict=True))
LEAVES = [path for path in PATHS if path[-1] not in PARENTS]
NAMES = ["w0", "w1", "w2", "w3", "w4"]
CLUSTERS = ["pd", "prfaas"]
ROLES: list[Role] = ["prefill", "decode"]


def fake_clock() -> Callable[[], float]:
    ticks = itertools.count()
    return lambda: float(next(ticks))


class Model:
    """The obvious model: worker -> (cluster, role, {hash: holds snapshot})."""

    def __init__(self) -> None:
        self.cluster: dict[str, str] = {}
        self.role: dict[str, Role] = {}
        self.blocks: dict[str, dict[int, bool]] = {}

    def lengths(self, name: str, path: list[int]) -> tuple[int, int]:
        blocks, held = self.blocks[name], 0
        while held < len(path) and path[held] in blocks:
            held += 1
        return held, max((i + 1 for i in range(held) if blocks[path[i]]), default=0)

    def match(self, path: list[int], role: Role | None) -> PrefixMatch:
        workers = []
        for name in sorted(self.blocks):
            held, resumable = self.lengths(name, path)
            if held and role in (None, self.role[name]):
                workers.append(
                    WorkerMatch(name, self.cluster[name], self.role[name], held, resumable)
                )
        clusters = []
        for cluster in sorted(set(self.cluster.values())):
            mine = [w for w in workers if w.cluster == cluster]
            best = sorted(mine, key=lambda w: (-w.blocks_resumable, -w.blocks_held, w.worker))
            clusters.append(
                ClusterMatch(
                    cluster,
                    max((w.blocks_held for w in mine), default=0),
                    max((w.blocks_resumable for w in mine), default=0),
                    best[0].worker if best else None,
                )
            )
        return PrefixMatch(len(path), workers, clusters)

    def plan(self, path: list[int], target: str, source: str | None) -> TransferPlan:
        held, resumable = self.lengths(target, path)
        others = [n for n in sorted(self.blocks) if n != target and self.lengths(n, path)[0]]
        if source is None and others:
            local = [n for n in others if self.cluster[n] == self.cluster[target]]
            source = max(others, key=lambda n: (self.lengths(n, path)[0], n in local))
        send = [i for i in range(held, len(path)) if path[i] not in self.blocks[target]]
        return TransferPlan(
            len(path), target, held, resumable, source,
            self.lengths(source, path)[0] if source else 0,
            source is not None and self.cluster[source] != self.cluster[target],
            send, resumable < len(path),
        )

    def report(self, name: str) -> WorkerReport:
        runs = [
            BlockRun([h], [DEPTH[h]] if snap else [], DEPTH[h], PARENT_OF[h])
            for h, snap in self.blocks[name].items()
        ]
        return WorkerReport(name, self.cluster[name], self.role[name], runs)


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = CacheDirectory(clock=fake_clock())
        self.model = Model()

    @rule(
        name=st.sampled_from(NAMES),
        cluster=st.sampled_from(CLUSTERS),
        role=st.sampled_from(ROLES),
    )
    def register(self, name: str, cluster: str, role: Role) -> None:
        if name in self.model.blocks:
            with pytest.raises(ValueError, match=f"worker '{name}' is already registered"):
                self.directory.register_worker(name, cluster, role)
            return
        self.directory.register_worker(name, cluster, role)
        self.model.cluster[name], self.model.role[name] = cluster, role
        self.model.blocks[name] = {}

    @rule(name=st.sampled_from(NAMES))
    def forget(self, name: str) -> None:
        if name not in self.model.blocks:
            with pytest.raises(UnknownWorkerError, match=f"worker '{name}'"):
                self.directory.forget_worker(name)
            return
        self.directory.forget_worker(name)
        event = self.directory.drain_events()[-1]
        held = len(self.model.blocks[name])
        assert (event.kind, event.worker, event.n_blocks) == ("forgotten", name, held)
        for table in (self.model.cluster, self.model.role, self.model.blocks):
            del table[name]

    @rule(name=st.sampled_from(NAMES), node=st.integers(0, len(PATHS) - 1), data=st.data())
    def store(self, name: str, node: int, data: st.DataObject) -> None:
        path = PATHS[node]
        first = data.draw(st.integers(0, len(path) - 1))
        snaps = data.draw(st.sets(st.integers(first, len(path) - 1)))
        parent = path[first - 1] if first else None
        if name not in self.model.blocks:
            with pytest.raises(UnknownWorkerError):
                self.directory.stored(name, path[first:], snaps, first=first, parent=parent)
            return
        blocks = self.model.blocks[name]
        expected = sum(h not in blocks for h in path[first:])
        got = self.directory.stored(name, path[first:], sorted(snaps), first=first, parent=parent)
        assert got == expected
        for depth, block in enumerate(path[first:], start=first):
            blocks[block] = blocks.get(block, False) or depth in snaps
        event = self.directory.drain_events()[-1]
        assert (event.kind, event.worker, event.n_blocks) == ("stored", name, expected)

    @rule(
        name=st.sampled_from(NAMES),
        hashes=st.lists(st.sampled_from(HASHES), max_size=8),
        snapshots_only=st.booleans(),
    )
    def evict(self, name: str, hashes: list[int], snapshots_only: bool) -> None:
        if name not in self.model.blocks:
            with pytest.raises(UnknownWorkerError):
                self.directory.evicted(name, hashes, snapshots_only)
            return
        blocks, expected = self.model.blocks[name], 0
        for block in hashes:
            if block in blocks and not snapshots_only:
                expected += 1
                del blocks[block]
            elif blocks.get(block) and snapshots_only:
                blocks[block] = False
        assert self.directory.evicted(name, hashes, snapshots_only) == expected

    @rule(
        name=st.sampled_from(NAMES),
        cluster=st.sampled_from(CLUSTERS),
        role=st.sampled_from(ROLES),
        blocks=st.dictionaries(st.sampled_from(HASHES), st.booleans(), max_size=12),
    )
    def replace(self, name: str, cluster: str, role: Role, blocks: dict[int, bool]) -> None:
        self.model.cluster[name], self.model.role[name] = cluster, role
        self.model.blocks[name] = dict(blocks)
        self.directory.replace_worker(self.model.report(name))

    @rule(data=st.data())
    def rebuild(self, data: st.DataObject) -> None:
        names = data.draw(st.permutations(sorted(self.model.blocks)))
        self.directory.rebuild(self.model.report(name) for name in names)
        assert self.directory.drain_events()[-1].kind == "rebuilt"

    @precondition(lambda self: bool(self.model.blocks))
    @rule(data=st.data())
    def bad_rebuild_changes_nothing(self, data: st.DataObject) -> None:
        before = self.directory.statistics()
        name = data.draw(st.sampled_from(sorted(self.model.blocks)))
        with pytest.raises(ValueError, match="reports name a worker twice"):
            self.directory.rebuild([self.model.report(name), self.model.report(name)])
        lie = BlockRun([HASHES[0]], first=1, parent=MAX_HASH)
        liar = WorkerReport("liar", "pd", "prefill", [lie])
        with pytest.raises(ChainError):
            self.directory.rebuild([self.model.report(name), _single_block("honest", 0), liar])
        assert self.directory.statistics() == before

    @rule(node=st.integers(0, len(PATHS) - 1))
    def conflicting_store_is_rejected(self, node: int) -> None:
        block = HASHES[node]
        # Held blocks surely have a node; unheld ancestors may or may not.
        if not any(block in blocks for blocks in self.model.blocks.values()):
            return
        name = sorted(self.model.blocks)[0]
        before = self.directory.statistics()
        with pytest.raises(ChainError, match=f"block {block} reported"):
            self.directory.stored(name, [block], first=DEPTH[block] + 1, parent=MAX_HASH)
        assert self.directory.statistics() == before

    @precondition(lambda self: bool(self.model.blocks))
    @rule(name=st.sampled_from(NAMES), role=st.sampled_from(ROLES))
    def set_role(self, name: str, role: Role) -> None:
        if name in self.model.blocks:
            self.directory.set_role(name, role)
            self.model.role[name] = role

    @rule(node=st.integers(0, len(PATHS) - 1), role=st.sampled_from([None, *ROLES]))
    def lookup(self, node: int, role: Role | None) -> None:
        path = PATHS[node]
        expected = self.model.match(path, role)
        assert self.directory.longest_prefix(path, role) == expected
        assert self.directory.longest_prefix_reference(path, role) == expected

    @precondition(lambda self: bool(self.model.blocks))
    @rule(node=st.integers(0, len(PATHS) - 1), data=st.data())
    def plan(self, node: int, data: st.DataObject) -> None:
        names = sorted(self.model.blocks)
        target = data.draw(st.sampled_from(names))
        source = data.draw(st.sampled_from([None, *names]))
        got = self.directory.transfer_plan(PATHS[node], target, source)
        assert got == self.model.plan(PATHS[node], target, source)

    @invariant()
    def consistent(self) -> None:
        self.directory.check_integrity()
        stats = self.directory.statistics()
        blocks = self.model.blocks.values()
        assert stats.workers == len(self.model.blocks)
        assert stats.block_entries == sum(len(b) for b in blocks)
        assert stats.snapshots == sum(sum(b.values()) for b in blocks)
        assert stats.blocks == len({h for b in blocks for h in b})
        for path in LEAVES:
            assert self.directory.longest_prefix(path) == self.model.match(path, None)


def _single_block(worker: str, node: int) -> WorkerReport:
    """A report holding one universe block, where the universe says it sits."""
    block = HASHES[node]
    run = BlockRun([block], [], DEPTH[block], PARENT_OF[block])
    return WorkerReport(worker, "pd", "decode", [run])


TestDirectoryMachine = DirectoryMachine.TestCase
TestDirectoryMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def _deep_directory() -> tuple[CacheDirectory, list[int]]:
    """Long chains from block_hashes-like ids with many distinct held lengths."""
    chain = chain_from_ids(range(300))
    branch = chain[:120] + chain_from_ids(range(1000, 1180))
    directory = CacheDirectory(clock=fake_clock())
    rng = random.Random(5)
    for index in range(12):
        name, cluster = f"w{index:02}", CLUSTERS[index % 2]
        directory.register_worker(name, cluster, ROLES[index % 3 % 2])
        length = rng.randrange(1, 300)
        source = branch if index % 4 == 0 else chain
        directory.stored(name, source[:length], rng.sample(range(length), 3))
        directory.evicted(name, [source[rng.randrange(length)]] if index % 3 == 0 else [])
    return directory, chain


def test_fast_lookup_equals_reference_on_long_chains() -> None:
    directory, chain = _deep_directory()
    directory.check_integrity()
    for length in (0, 1, 119, 120, 121, 299, 300):
        for role in (None, *ROLES):
            got = directory.longest_prefix(chain[:length], role)
            assert got == directory.longest_prefix_reference(chain[:length], role)
    assert len(directory.longest_prefix(chain).workers) >= 6


def test_resumable_needs_a_snapshot_at_the_boundary() -> None:
    directory, chain = CacheDirectory({"a": "pd", "b": "prfaas"}), chain_from_ids(range(10))
    directory.stored("a", chain[:8], [3])
    directory.stored("b", chain[:5], [4])
    match = directory.longest_prefix(chain)
    assert [(w.blocks_held, w.blocks_resumable) for w in match.workers] == [(8, 4), (5, 5)]
    assert match.cluster("pd") == ClusterMatch("pd", 8, 4, "a")
    directory.evicted("a", [chain[3]], snapshots_only=True)
    assert directory.longest_prefix(chain).cluster("pd") == ClusterMatch("pd", 8, 0, "a")
    with pytest.raises(UnknownWorkerError, match="cluster 'edge'"):
        match.cluster("edge")


def test_transfer_plan_sends_only_what_the_target_lacks() -> None:
    directory = CacheDirectory(clock=fake_clock())
    directory.register_worker("p1", "prfaas", "prefill")
    directory.register_worker("d1", "pd", "decode")
    directory.register_worker("d2", "pd", "decode")
    chain = chain_from_ids(range(10))
    directory.stored("p1", chain, [9])
    directory.stored("d1", chain[:4], [3])
    directory.stored("d1", chain[6:7], first=6, parent=chain[5])
    directory.stored("d2", chain[:6])
    plan = directory.transfer_plan(chain, "d1")
    assert plan == TransferPlan(10, "d1", 4, 4, "p1", 10, True, [4, 5, 7, 8, 9], True)
    local = directory.transfer_plan(chain[:6], "d1")
    assert (local.source_worker, local.cross_cluster, local.send) == ("d2", False, [4, 5])
    done = directory.transfer_plan(chain, "p1", source_worker="d2")
    assert (done.send, done.states_needed, done.source_held) == ([], False, 6)
    with pytest.raises(UnknownWorkerError, match="worker 'nobody'"):
        directory.transfer_plan(chain, "nobody")


def test_events_statistics_and_outbox_overflow() -> None:
    directory = CacheDirectory({"a": "pd"}, clock=fake_clock(), max_events=2)
    chain = chain_from_ids(range(4))
    directory.stored("a", chain, [1, 3])
    directory.stored("a", chain[:2])
    directory.evicted("a", [chain[3], chain[3], 12345])
    events = directory.drain_events()
    assert [(e.kind, e.n_blocks, e.n_snapshots, e.seq, e.ts) for e in events] == [
        ("stored", 0, 0, 2, 1.0),
        ("evicted", 1, 1, 3, 2.0),
    ]
    assert directory.drain_events() == []
    stats = directory.statistics()
    assert stats == CacheDirectoryStatistics(
        workers=1, clusters=1, blocks=3, block_entries=3, snapshots=1, nodes=3, lookups=0,
        plans=0, stored_reports=2, evicted_reports=1, blocks_stored=4, blocks_evicted=1,
        stale_evictions=2, rebuilds=0, events_dropped=1,
    )
    with pytest.raises(ValueError, match="max_events must be >= 1, got 0"):
        CacheDirectory(max_events=0)


def test_rebuild_replaces_state_and_keeps_lookups() -> None:
    directory, chain = _deep_directory()
    before = directory.longest_prefix(chain)
    reports = []
    for w in before.workers:
        snaps = [w.blocks_resumable - 1] if w.blocks_resumable else []
        runs = [BlockRun(chain[: w.blocks_held], snaps)]
        reports.append(WorkerReport(w.worker, w.cluster, w.role, runs))
    directory.rebuild(reversed(reports))
    directory.check_integrity()
    after = directory.longest_prefix(chain)
    assert after.workers == before.workers
    assert directory.statistics().rebuilds == 1
    assert directory.drain_events()[-1].kind == "rebuilt"


def test_stored_checks_the_whole_message_before_applying() -> None:
    directory, chain = CacheDirectory({"a": "pd"}), chain_from_ids(range(4))
    good, bad = BlockRun(chain[:2]), BlockRun([chain[1]], first=1, parent=chain[2])
    with pytest.raises(ChainError, match=f"block {chain[1]} reported"):
        directory.apply_stored(BlocksStored("a", [good, bad]))
    assert directory.statistics().block_entries == 0
    with pytest.raises(ChainError, match="not a chain from block 0"):
        directory.stored("a", chain)
        directory.longest_prefix(chain[1:])


def test_empty_runs_and_queries_leave_no_trace() -> None:
    directory, chain = CacheDirectory({"a": "pd"}), chain_from_ids(range(3))
    assert directory.stored("a", [], first=2, parent=chain[1]) == 0
    assert directory.statistics().nodes == 0
    directory.check_integrity()
    assert directory.longest_prefix([]) == PrefixMatch(0, [], [ClusterMatch("pd", 0, 0, None)])
    assert directory.transfer_plan([], "a") == TransferPlan(0, "a", 0, 0, None, 0, False, [], False)
