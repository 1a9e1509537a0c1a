"""A live run of `prfaas validate-sim` against the simulation: each load simulated with each
profile and compared, over all requests and per route.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

from services.cli.validate.compare import compare, service_rate, ttft_parts
from services.cli.validate.config import ROUTES, Outcome, Row, ValidationConfig, by_route, compared
from services.cli.validate.jobs import burst, load_jobs, reruns_of
from services.cli.validate.live import LiveRun
from services.cli.validate.profiles import derive_profiles, with_unmodelled
from services.cli.validate.simulated import simulate


class Validation(msgspec.Struct, frozen=True):
    """A whole run: the capacities, each load's row (predicted: the headline), its TTFT
    parts, each side's records, and the diagnostics beside (calibrated on the load; the
    engine's profile alone)."""

    config: ValidationConfig
    live_capacity_rps: float
    sim_capacity_rps: float
    rows: list[Row]
    parts: dict[str, dict[str, float]]
    records: dict[str, dict[str, list[Outcome]]]
    wall_s: float
    load_averages: dict[str, str] = {}
    # Each load's decode drift (decode_drift): its decode steps' scale in the calibrated rows.
    decode_drift: dict[str, float] = {}
    calibrated: list[Row] = []
    engine_alone: list[Row] = []
    unmodelled_s: float = 0.0  # Profiles.unmodelled[""]: over all the in-situ probes
    # Each load simulated with its own requests' measured compute (`Profiles.replay`): the
    # queueing, batching and transfer judged alone. A separate figure, never the prediction.
    replay: list[Row] = []
    # The predicted rows split by route (`route_rows`): local and offloaded requests apart.
    routes: list[Row] = []
    # The unmodelled TTFT added (Profiles.unmodelled): overall ("") and per route.
    unmodelled_routes: dict[str, float] = {}


def against_sim(config: ValidationConfig, live: LiveRun, profiles: dict[str, str],
                unmodelled: Mapping[str, float] | None = None
                ) -> tuple[list[Row], dict[str, list[Outcome]]]:
    """Each load of `live` simulated with its profile in `profiles` (by load name), the
    `unmodelled` seconds added (`with_unmodelled`), and compared with it: the rows and the
    simulated outcomes, by load. What a load is simulated from is its arrival list as sent
    (its probes' lengths are the engine profile's) and the profile named: nothing of the
    load's own measurements."""
    rows, sims = [], {}
    for index, (name, fraction) in enumerate(config.loads):
        if name not in profiles:
            continue
        rate = fraction * live.capacity_rps
        own = msgspec.structs.replace(config, profile=profiles[name])
        sims[name] = sim = with_unmodelled(simulate(own, load_jobs(config, index, rate)),
                                           unmodelled or {})
        reruns = [compared(live.outcomes[again]) for again in reruns_of(name, live.outcomes)]
        rows.append(compare(name, rate, compared(live.outcomes[name]), compared(sim), reruns))
    return rows, sims


def route_rows(config: ValidationConfig, live: LiveRun,
               sims: dict[str, list[Outcome]]) -> list[Row]:
    """Each simulated load of `sims` compared with `live` per route (`by_route`): the local
    requests on both sides, then the offloaded ones, each as a row of its own (`Row.route`).
    Each side's requests are split by where its own router placed them; a route one side
    never took gets no row."""
    rows = []
    for name, fraction in config.loads:
        if name not in sims:
            continue
        live_runs = [by_route(compared(live.outcomes[run]))
                     for run in (name, *reruns_of(name, live.outcomes))]
        sim = by_route(compared(sims[name]))
        for route in ROUTES.values():
            if route in sim and all(route in run for run in live_runs):
                row = compare(name, fraction * live.capacity_rps, live_runs[0][route],
                              sim[route], [run[route] for run in live_runs[1:]])
                rows.append(msgspec.structs.replace(row, route=route))
    return rows


def evaluate(config: ValidationConfig, live: LiveRun, out: Path) -> Validation:
    """The whole comparison of a live run, its profiles written to `out`. The headline rows
    are predicted: every load simulated with the in-situ profile, measured before the loads.
    Beside them, as diagnostics, each load simulated with its calibrated profile (read from
    the load itself: what is left between it and the live run is modelling, not drift) and
    with the engine's profile alone."""
    profiles = derive_profiles(config, live, out)
    names = [name for name, _ in config.loads if name in live.outcomes]
    rows, sims = against_sim(config, live, dict.fromkeys(names, profiles.in_situ),
                             profiles.unmodelled)
    calibrated, _ = against_sim(config, live, profiles.calibrated, profiles.unmodelled)
    engine_alone, _ = against_sim(config, live, dict.fromkeys(names, config.profile))
    replay, _ = against_sim(config, live, profiles.replay, profiles.unmodelled)
    predicted = msgspec.structs.replace(config, profile=profiles.in_situ)
    sim_capacity = service_rate(simulate(predicted, burst(config))) if (
        "capacity" in live.outcomes) else 0.0
    records: dict[str, dict[str, list[Outcome]]] = {
        name: {"live": live.outcomes[name]} for name in ("in-situ", "capacity")
        if name in live.outcomes}
    parts = {}
    for name in names:
        records[name] = {"live": live.outcomes[name], "sim": sims[name]}
        parts[name] = ttft_parts(predicted, compared(live.outcomes[name]), config.profile,
                                 profiles.in_situ)
    return Validation(config, live.capacity_rps, sim_capacity, rows, parts, records,
                      live.wall_s, live.load_averages, profiles.decode_drift, calibrated,
                      engine_alone, profiles.unmodelled.get("", 0.0), replay,
                      route_rows(config, live, sims), profiles.unmodelled)
