"""The buckets of every PrfaaS histogram, one series per unit, stated once here and in
docs/observability.md.

The system's times run from a fraction of a millisecond (a decode step of the small CPU model,
one gap between streamed tokens) to minutes (a 128K prompt's prefill on the emulated H20,
seconds long, behind a queue of them): `SECONDS_BUCKETS` spans 0.1 ms to 750 s with eight
bounds a decade (1, 1.5, 2, 2.5, 3, 4, 5, 7.5), so two neighbouring bounds are at most 1.5x
apart, and the SLO's 25 ms (40 tokens/s) is a bound. Token counts (1 to 1M) and KV bytes
(1 KiB to 64 GiB: a paper-scale 128K prefix is about 2.3 GiB) go in powers of two.

Each histogram (mesh.histogram) is owned by the object that observes it, never by a
process-wide registry: each service registers its owners' histograms in its own registry, and
the simulation merges every owner's into one report (mesh.metrics.MergedCollector).
"""

from __future__ import annotations

_DECADE = ("1", "1.5", "2", "2.5", "3", "4", "5", "7.5")

# Written as decimal literals so that each bound prints as it reads (le="0.025").
SECONDS_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{exponent}") for exponent in range(-4, 3) for m in _DECADE)
TOKENS_BUCKETS: tuple[float, ...] = tuple(float(2 ** k) for k in range(21))
BYTES_BUCKETS: tuple[float, ...] = tuple(float(2 ** k) for k in range(10, 37))

