"""The requests `prfaas validate-sim` sends, the same list to both sides: a load with its probes
riding in it, the in-situ probes, the capacity burst, and a load sent again.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from services.bench.arrivals import poisson_arrivals
from services.cli.validate.config import Job, Outcome, ValidationConfig
from services.model.config import family_config
from services.paper.hardware import (
    ProfileError,
    read_profile_spec,
)
from services.sim.workload import BLOCK, Arrival


def jobs(config: ValidationConfig, rate: float, count: int, seed: int,
         burst_s: float | None = None, lengths: Sequence[int | None] = ()) -> list[Job]:
    """`count` requests, Poisson at `rate` (or spread evenly over `burst_s`), seeded lengths
    (or the prompt lengths given; None: a seeded one) and output lengths."""
    rng = random.Random(seed)
    times = ([burst_s * i / count for i in range(count)] if burst_s is not None
             else poisson_arrivals(count, rate, rng))
    vocab = family_config(config.family, config.size).vocab_size
    out = []
    # Fresh blocks per request, in both worlds: nothing is shared, nothing cached. Each load
    # (seed) numbers its blocks from its own billion, each request after the last one's.
    first = seed * 1_000_000_000
    for index, at in enumerate(times[:count]):
        given = lengths[index] if lengths else None
        length = given if given is not None else rng.randint(*config.prompt_tokens)
        output = rng.randint(*config.output_tokens)
        blocks = tuple(range(first, first + length // BLOCK + 1))
        first += len(blocks)
        prompt = [rng.randrange(1, vocab) for _ in range(length)]
        out.append(Job(Arrival(at, blocks, length, output, length), prompt))
    return out


def rerun_name(load: str, index: int) -> str:
    """The live outcomes' key of a load's `index`th run (0: the load's own name)."""
    return load if index == 0 else f"{load} run {index + 1}"


def reruns_of(load: str, outcomes: dict[str, list[Outcome]]) -> list[str]:
    """The keys of `load`'s runs after its first, in order, as far as they were run."""
    names: list[str] = []
    while rerun_name(load, len(names) + 1) in outcomes:
        names.append(rerun_name(load, len(names) + 1))
    return names


def rerun_jobs(config: ValidationConfig, load: Sequence[Job], index: int) -> list[Job]:
    """The same load sent again (its `index`th run): the same arrival times, lengths, output
    lengths and probe places, with fresh prompts and blocks, so nothing of an earlier run is
    cached. The simulation of every run is the same (it is one arrival list)."""
    if index == 0:
        return list(load)
    rng = random.Random(config.seed * 1000 + 500 + index)
    vocab = family_config(config.family, config.size).vocab_size
    # Past every seed's billion of blocks (`jobs`).
    shift = index * 1_000_000_000_000
    return [msgspec.structs.replace(
        job, prompt=[rng.randrange(1, vocab) for _ in job.prompt],
        arrival=msgspec.structs.replace(
            job.arrival, blocks=tuple(b + shift for b in job.arrival.blocks)))
        for job in load]


def burst(config: ValidationConfig) -> list[Job]:
    return jobs(config, 1.0, config.capacity_requests, config.seed + 98, burst_s=1.0)


def load_jobs(config: ValidationConfig, index: int, rate: float) -> list[Job]:
    """Load `index` at `rate`: `config.requests` requests and, in seeded places among them,
    the in-load probes (each profiled prompt length `load_probe_repeats` times), one Poisson
    arrival list in all. The probes measure the prefill worker's speed while it serves this
    load (`load_profile`); the load's own requests are what the two sides are compared on."""
    rng = random.Random(config.seed + 80 + index)
    probes = _probe_lengths(config, config.load_probe_repeats, rng)
    count = config.requests + len(probes)
    places = set(rng.sample(range(count), len(probes)))
    order = iter(probes)
    load = jobs(config, rate, count, config.seed + index,
                lengths=[next(order) if i in places else None for i in range(count)])
    return [msgspec.structs.replace(job, probe=True) if i in places else job
            for i, job in enumerate(load)]


def probe_jobs(config: ValidationConfig, rate: float = 0.0) -> list[Job]:
    """The in-situ probes: every prompt length the engine's profile measured, `probe_repeats`
    times over in a seeded order, Poisson at `rate` (0: all at once, for one at a time), with
    the loads' output lengths. Their own seed: no arrival, prompt or block of a load."""
    lengths = _probe_lengths(config, config.probe_repeats, random.Random(config.seed + 96))
    if rate > 0:
        return jobs(config, rate, len(lengths), config.seed + 97, lengths=lengths)
    return jobs(config, 1.0, len(lengths), config.seed + 97, burst_s=0.0, lengths=lengths)


def _probe_lengths(config: ValidationConfig, repeats: int, rng: random.Random) -> list[int]:
    """Every prompt length the engine's profile measured, `repeats` times, in `rng`'s order."""
    spec = read_profile_spec(config.profile)
    if spec.prefill is None:
        raise ProfileError(f"profile {config.profile!r} has no prefill points to probe")
    lengths = [round(x) for x in spec.prefill.lengths] * repeats
    rng.shuffle(lengths)
    return lengths
