"""What a `prfaas validate-sim` run is configured with and the records it passes along: the
configuration, a load's job, a request's outcome, a compared row, and the deployments validated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from mesh.errors import ConfigError
from services.sim.workload import Arrival


class ValidationConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What runs and what is sent (the command's docstring)."""

    profile: str = "vm-xeon-spr-1t"
    model: str = "kimi-linear-default"
    family: str = "kimi-linear"
    size: str = "default"
    checkpoint: str = "auto"
    requests: int = 150
    loads: tuple[tuple[str, float], ...] = (("light", 0.3), ("60%", 0.6), ("85%", 0.85))
    prompt_tokens: tuple[int, int] = (128, 384)  # uniform; 2 to 6 chunks of 64
    output_tokens: tuple[int, int] = (16, 48)
    chunk_tokens: int = 64
    snapshot_every: int = 1
    capacity_requests: int = 48
    capacity_rps: float = 0.0  # 0: measured with a burst of capacity_requests
    warmup_requests: int = 4
    probe_repeats: int = 6  # in-situ probes per profiled prompt length
    # The probes' Poisson rate as a fraction of the capacity (in_situ_profile); 0: one at a time.
    probe_load: float = 0.5
    # Probes riding inside each load, per profiled length (load_jobs); 0: the loads are
    # simulated with the in-situ block's prefill fit.
    load_probe_repeats: int = 6
    bandwidth_bps: float = 10e9
    delay_s: float = 0.001
    # PD prefill workers beside the PrfaaS one: 0, every request remote (threshold 0); 1, the
    # router decides by `threshold` (`routed`).
    pd_prefill: int = 0
    threshold: int = 0  # the prfaas policy's t, in prompt tokens (no prefix is ever cached)

    def __post_init__(self) -> None:
        if self.pd_prefill not in (0, 1):
            raise ConfigError(f"pd_prefill must be 0 or 1 (the live mesh has at most one PD "
                              f"prefill worker), got {self.pd_prefill!r}")
    seed: int = 0
    # Each load sent this many times over (fresh prompts, the same arrivals): the live side's
    # own run-to-run spread (`live_spread`), the floor any simulation can reach.
    repeats: int = 1
    pin: bool = True  # pin_cores: each worker's compute on a CPU of its own where it can


class Job(msgspec.Struct, frozen=True):
    """One request of a load: the simulation's arrival and the live prompt of equal length."""

    arrival: Arrival
    prompt: list[int]
    probe: bool = False  # an in-load probe: calibrates the load's prefill fit, not compared


class Outcome(msgspec.Struct, frozen=True):
    """One request as the router saw it; the prefill parts from the worker's report (live)."""

    at: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    ok: bool
    queue_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    error: str = ""
    probe: bool = False  # its job's (Job.probe)
    cluster: str = ""  # where the router prefilled it: "prfaas" (offloaded) or "pd" (local)


class Row(msgspec.Struct, frozen=True):
    """One load compared: the live figures (the median over its runs), the simulated ones,
    the signed errors, and the live side's own spread over its runs (empty: one run)."""

    load: str
    rate: float
    requests: int
    live: dict[str, float]
    sim: dict[str, float]
    errors: dict[str, float]
    live_spread: dict[str, float] = {}
    route: str = ""  # "local" / "offloaded": that route's requests only (`route_rows`); "": all


# What the deployments validated are called in the JSON line (a row per deployment and load):
# one PrfaaS prefill and one decode worker, every request remote; and `routed`'s.
DEPLOYMENT = "remote-1p1d"
ROUTED = "routed-1+1p1d"
# The routed deployment's link: a 320-token prompt's KV (0.95 MiB, most of it the linear
# layers' state) takes 0.2 s at 40 Mbit/s, about its prefill on a 2-vCPU host, so the link
# queues once offloaded requests come faster than a few a second (docs/simulation.md).
ROUTED_BANDWIDTH_BPS = 40e6
# The route a request took, by the cluster that prefilled it.
ROUTES = {"pd": "local", "prfaas": "offloaded"}


def routed(config: ValidationConfig) -> ValidationConfig:
    """`config` as the routed deployment: a PD prefill worker beside the PrfaaS one, t in the
    middle of the prompt lengths (short requests local, long ones offloaded), the link shaped
    to `ROUTED_BANDWIDTH_BPS`."""
    low, high = config.prompt_tokens
    return msgspec.structs.replace(config, pd_prefill=1, threshold=(low + high) // 2,
                                   bandwidth_bps=ROUTED_BANDWIDTH_BPS)


DEPLOYMENTS: dict[str, Callable[[ValidationConfig], ValidationConfig]] = {
    DEPLOYMENT: lambda config: config, ROUTED: routed}


def deployment_name(config: ValidationConfig) -> str:
    """What `config`'s deployment is called in the JSON line."""
    return f"routed-1+{config.pd_prefill}p1d" if config.pd_prefill else DEPLOYMENT


def policy_options(config: ValidationConfig) -> dict[str, Any]:
    """The prfaas policy's options on both sides: `config`'s t, the scarce prefix rule."""
    return {"threshold": config.threshold, "prefix_rule": "scarce"}


def compared(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """A load's own requests, without the probes riding in it (`load_jobs`)."""
    return [o for o in outcomes if not o.probe]


def by_route(outcomes: Sequence[Outcome]) -> dict[str, list[Outcome]]:
    """The outcomes split by the route each took (`ROUTES`), in their order."""
    split: dict[str, list[Outcome]] = {}
    for o in outcomes:
        split.setdefault(ROUTES.get(o.cluster, o.cluster or "unplaced"), []).append(o)
    return split


def slug(load: str) -> str:
    return load.replace("%", "pct")
