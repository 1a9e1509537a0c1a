"""The figures `prfaas validate-sim` compares and how: TTFT, TPOT and end-to-end percentiles and
completions per second over one side's outcomes, the live side's own spread, a load's row of
signed errors, and what the live TTFT is made of.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from services.bench.stats import percentile
from services.cli.validate.config import Outcome, Row, ValidationConfig
from services.paper.hardware import (
    CostModel,
)

METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
           "e2e_p50", "e2e_p90", "e2e_p99", "completed_rps")
PERCENTILES = {"p50": 50, "p90": 90, "p99": 99}


def completed_rps(outcomes: Sequence[Outcome]) -> float:
    """Completions per second from the first arrival to the last completion."""
    ok = [o for o in outcomes if o.ok]
    if not ok:
        return 0.0
    span = max(o.at + o.e2e_s for o in ok) - min(o.at for o in outcomes)
    return len(ok) / span


def service_rate(outcomes: Sequence[Outcome]) -> float:
    """Completions per second over the middle half of the finishes (a burst's steady state)."""
    ends = sorted(o.at + o.e2e_s for o in outcomes if o.ok)
    low, high = len(ends) // 4, 3 * len(ends) // 4
    if len(ends) < 4 or ends[high] <= ends[low]:
        raise ValueError(f"need a burst of >= 4 completed requests, got {len(ends)}")
    return (high - low) / (ends[high] - ends[low])


def metrics(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Every figure of METRICS over the completed requests, and how many completed."""
    ok = [o for o in outcomes if o.ok]
    series = {"ttft": [o.ttft_s for o in ok], "e2e": [o.e2e_s for o in ok],
              "tpot": [o.tpot_s for o in ok if o.output_tokens > 1]}
    figures = {f"{name}_{p}": percentile(values, q) if values else math.nan
               for name, values in series.items() for p, q in PERCENTILES.items()}
    return {**figures, "completed_rps": completed_rps(outcomes), "completed": float(len(ok))}


def live_figures(runs: Sequence[Sequence[Outcome]]) -> dict[str, float]:
    """The live side's figures over its runs of one load: each the median of the runs'."""
    each = [metrics(run) for run in runs]
    return {k: statistics.median(m[k] for m in each) for k in each[0]}


def live_spread(runs: Sequence[Sequence[Outcome]]) -> dict[str, float]:
    """The live side's own run-to-run spread on one load: per figure, the range of its runs'
    values over their median (0.1: the runs lie within 10% of each other); empty with
    fewer than two runs. No simulation can be held closer than this."""
    if len(runs) < 2:
        return {}
    each = [metrics(run) for run in runs]
    spread = {}
    for key in METRICS:
        values = [m[key] for m in each]
        middle = statistics.median(values)
        spread[key] = (max(values) - min(values)) / middle if middle else math.inf
    return spread


def compare(load: str, rate: float, live: Sequence[Outcome], sim: Sequence[Outcome],
            reruns: Sequence[Sequence[Outcome]] = ()) -> Row:
    """Signed relative errors, sim over live minus 1, per metric; the live side is the
    median over `live` and its `reruns` (the same load sent again), their spread beside."""
    runs = [live, *reruns]
    a, b = live_figures(runs), metrics(sim)
    errors = {k: b[k] / a[k] - 1.0 if a[k] else math.inf for k in METRICS}
    return Row(load, rate, len(live), a, b, errors, live_spread(runs))


def ttft_parts(config: ValidationConfig, live: Sequence[Outcome],
               engine_profile: str = "", block_profile: str = "") -> dict[str, float]:
    """Mean seconds of what the live TTFT is made of; `profile` is `config`'s profile's prefill
    time for the same prompts (what the simulation's compute takes), `engine` the engine's
    profile's alone (no in-situ probes) and `in-situ` `block_profile`'s (the in-situ block's),
    when given (beside a load's own profile, the drift between the two)."""
    ok = [o for o in live if o.ok]
    cost = CostModel.load(config.profile, config.model)
    engine = CostModel.load(engine_profile or config.profile, config.model)
    situ = CostModel.load(block_profile or config.profile, config.model)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else 0.0
    return {"ttft": mean([o.ttft_s for o in ok]), "queue": mean([o.queue_s for o in ok]),
            "compute": mean([o.compute_s for o in ok]),
            "profile": mean([cost.prefill_time(o.prompt_tokens) for o in ok]),
            "engine": mean([engine.prefill_time(o.prompt_tokens) for o in ok]),
            "in-situ": mean([situ.prefill_time(o.prompt_tokens) for o in ok]),
            "rest": mean([o.ttft_s - o.queue_s - o.compute_s for o in ok])}
