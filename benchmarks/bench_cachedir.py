"""Benchmark: CacheDirectory.longest_prefix over ~100k cached blocks.

Setup: 32 workers in two clusters; 120 shared roots (system prompts, documents) of up to 400
blocks; each worker holds ~10 conversations, each a prefix of a root plus its own turns, with a
state snapshot every 16 blocks and at the end. Queries: prompts of 10..2000 blocks; 80% continue
a stored conversation from a random point, 20% share only (part of) a root; then fresh blocks.

Compared in the same run on the same queries:
- fast: `longest_prefix` (binary search over unbroken-chain holder masks);
- linear: the obvious inverted index (hash -> holder bitmask) walked block by block until no
  one holds the block; held lengths only, so it does less than the others;
- reference: `longest_prefix_reference`, every worker's blocks walked (brute force).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import count

import msgspec

from services.cachedir.directory import CacheDirectory
from services.contract.messages import PrefixQuery
from services.contract.prefix import chain_from_ids

N_WORKERS = 32
N_ROOTS = 120
ROOT_BLOCKS = 400
CONVERSATIONS_PER_WORKER = 10
MAX_TURN_BLOCKS = 440
SNAPSHOT_EVERY = 16


class Corpus:
    """Block-id sequences; ids name a block in its context, so chain_from_ids gives prefixes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.fresh = count(10**9)
        self.roots = [[r * 10**6 + j for j in range(ROOT_BLOCKS)] for r in range(N_ROOTS)]
        self.conversations: list[list[int]] = []

    def conversation(self) -> list[int]:
        root = self.rng.choice(self.roots)
        shared = root[: self.rng.randrange(1, ROOT_BLOCKS + 1)]
        ids = shared + [next(self.fresh) for _ in range(self.rng.randrange(MAX_TURN_BLOCKS))]
        self.conversations.append(ids)
        return ids

    def query(self) -> list[int]:
        length = self.rng.randrange(10, 2001)
        if self.rng.random() < 0.8:
            base = self.rng.choice(self.conversations)
        else:
            base = self.rng.choice(self.roots)
        ids = base[: self.rng.randrange(1, len(base) + 1)][:length]
        return ids + [next(self.fresh) for _ in range(length - len(ids))]


def build(rng: random.Random) -> tuple[CacheDirectory, dict[int, int], Corpus]:
    corpus = Corpus(rng)
    directory = CacheDirectory()
    inverted: dict[int, int] = {}
    for worker in range(N_WORKERS):
        name = f"w{worker:02}"
        directory.register_worker(name, "prfaas" if worker < 8 else "pd")
        for _ in range(CONVERSATIONS_PER_WORKER):
            chain = chain_from_ids(corpus.conversation())
            snapshots = [*range(SNAPSHOT_EVERY - 1, len(chain), SNAPSHOT_EVERY), len(chain) - 1]
            directory.stored(name, chain, snapshots)
            for block in chain:
                inverted[block] = inverted.get(block, 0) | 1 << worker
    return directory, inverted, corpus


def linear_walk(inverted: dict[int, int], hashes: Sequence[int]) -> dict[int, int]:
    """Held length per worker bit, walking the query once until no one holds a block."""
    held: dict[int, int] = {}
    alive = -1
    for index, block in enumerate(hashes):
        holders = inverted.get(block, 0) & alive
        dropped = alive & ~holders if index else 0
        while dropped:
            lowest = dropped & -dropped
            held[lowest.bit_length() - 1] = index
            dropped ^= lowest
        alive = holders
        if not alive:
            return held
    while alive > 0:
        lowest = alive & -alive
        held[lowest.bit_length() - 1] = len(hashes)
        alive ^= lowest
    return held


def timed(call: Callable[[Sequence[int]], object], hashes: Sequence[int]) -> float:
    start = time.perf_counter_ns()
    call(hashes)
    return (time.perf_counter_ns() - start) / 1000


def run_queries(
    directory: CacheDirectory, inverted: dict[int, int], corpus: Corpus, n: int, n_reference: int
) -> tuple[dict[str, list[float]], list[int], list[int]]:
    """Microseconds per lookup for each method, one method per pass over the same queries.

    Like the directory service, each lookup gets a query freshly decoded from msgpack
    (untimed), so its hash list is new in memory while the directory's entries may not be.
    """
    wire = [msgspec.msgpack.encode(PrefixQuery(chain_from_ids(corpus.query()))) for _ in range(n)]
    decoder = msgspec.msgpack.Decoder(PrefixQuery)
    methods: dict[str, Callable[[Sequence[int]], object]] = {
        "fast": directory.longest_prefix,
        "linear": lambda hashes: linear_walk(inverted, hashes),
        "reference": directory.longest_prefix_reference,
    }
    times: dict[str, list[float]] = {}
    for name, call in methods.items():
        sample = wire[:n_reference] if name == "reference" else wire
        times[name] = [timed(call, decoder.decode(message).hashes) for message in sample]
    queries = [decoder.decode(message).hashes for message in wire]
    for hashes in queries[:n_reference]:
        assert directory.longest_prefix(hashes) == directory.longest_prefix_reference(hashes)
    matched = [max((w.blocks_held for w in directory.longest_prefix(q).workers), default=0)
               for q in queries]
    return times, matched, [len(q) for q in queries]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 queries instead of 1000")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    n_queries, n_reference = (300, 60) if args.quick else (1000, 200)

    rng = random.Random(args.seed)
    started = time.perf_counter()
    directory, inverted, corpus = build(rng)
    build_s = time.perf_counter() - started
    # Warm-up: the host is noisy (docs/engineering-notes.md G12).
    run_queries(directory, inverted, corpus, 50, 10)
    gc.collect()
    times, matched, lengths = run_queries(directory, inverted, corpus, n_queries, n_reference)
    fast, linear, reference = times["fast"], times["linear"], times["reference"]
    stats = directory.statistics()
    per_block_ns = [1000 * t / n for t, n in zip(fast, lengths, strict=True)]

    print(f"cache directory: {stats.workers} workers, {stats.blocks:,} distinct blocks cached, "
          f"{stats.block_entries:,} (worker, block) entries, {stats.snapshots:,} snapshots; "
          f"built in {build_s:.1f} s")
    print(f"queries: {n_queries} prompts of 10..2000 blocks; longest held prefix median "
          f"{statistics.median(matched):.0f} blocks, max {max(matched)}")
    print(f"{'lookup':<34}{'queries':>8}{'median us':>12}{'p99 us':>10}")
    rows = [("fast (binary search, full answer)", fast), ("linear inverted-index walk", linear),
            ("reference (brute force)", reference)]
    for label, samples in rows:
        print(f"{label:<34}{len(samples):>8}{statistics.median(samples):>12.1f}"
              f"{percentile(samples, 0.99):>10.1f}")
    fast_median = statistics.median(fast)
    reference_median = statistics.median(reference)
    # The ratio compares medians over the same queries.
    ratio = reference_median / statistics.median(fast[:n_reference])
    print(f"fast per query block: median {statistics.median(per_block_ns):.1f} ns; "
          f"reference / fast: {ratio:.1f}x on the first {n_reference} queries")
    print(json.dumps({
        "bench": "cachedir",
        "lookup_100k_us_median": round(fast_median, 2),
        "lookup_100k_us_p99": round(percentile(fast, 0.99), 2),
        "reference_us_median": round(reference_median, 2),
        "reference_over_fast": round(ratio, 2),
        "linear_walk_us_median": round(statistics.median(linear), 2),
        "cached_blocks": stats.blocks,
        "block_entries": stats.block_entries,
        "workers": stats.workers,
        "queries": n_queries,
        "quick": args.quick,
    }))


if __name__ == "__main__":
    main()
