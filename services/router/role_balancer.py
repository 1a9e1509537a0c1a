"""The long-term loop of `prfaas-dynamic` (`RoleBalancer`): converting PD workers between
prefill and decode when one stage is the bottleneck (paper section 3.4.3, Eq. 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from services.paper.planner import (
    ClusterShape,
)
from services.router.policy import ClusterState, ConvertWorker, PolicyError, WorkerSnapshot

# The model's (Theta_prfaas, Theta_pd-p, Theta_pd-d) in requests/s for a shape
Rates = tuple[float, float, float]
Estimator = Callable[[ClusterShape], Rates]
# Each stage's load (its arrivals over its rate) for a shape at the arrival rate measured now;
# None without traffic
Loads = Callable[[ClusterShape], Rates | None]


class RoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    period_s: float = 60.0
    imbalance: float = 2.0
    min_backlog: float = 2.0  # mean queued requests per worker before a stage counts as backed up
    min_role_workers: int = 1  # never convert the last worker(s) of a role
    margin: float = 0.3  # Eq. 8 may be off by this fraction before a conversion
    # Eq. 8 converts only while the busiest stage runs at least this loaded at the measured
    # arrival rate: below it the shape limits nothing, and a conversion would only cost its
    # drain and reload and spend the headroom of the role it takes from (a burst needs it).
    min_load: float = 0.6
    # No conversion undoes the last one within this long (a conversion drains a worker and
    # reloads it: one that the next period reverses costs twice and gains nothing).
    cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("period_s", "imbalance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PolicyError(f"roles.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.min_backlog) and self.min_backlog >= 0):
            raise PolicyError(f"roles.min_backlog must be >= 0, got {self.min_backlog!r}")
        for name in ("margin", "cooldown_s", "min_load"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PolicyError(f"roles.{name} must be >= 0, got {value!r}")
        if self.min_role_workers < 1:
            raise PolicyError(f"roles.min_role_workers must be >= 1, got "
                              f"{self.min_role_workers!r}")


def shape_of(state: ClusterState) -> ClusterShape:
    """Serving instances per stage; draining workers count for neither role."""
    return ClusterShape(len(state.select("prfaas", "prefill")),
                        len(state.select("pd", "prefill")), len(state.select("pd", "decode")))


def _mean_queue(workers: list[WorkerSnapshot]) -> float:
    return sum(w.backlog for w in workers) / len(workers) if workers else 0.0


def _least_loaded(workers: list[WorkerSnapshot]) -> WorkerSnapshot:
    return min(workers, key=lambda w: (w.backlog + w.running, w.name))


def eq8_gap(rates: Rates) -> float:
    """How far Eq. 8 is off: log((Theta_prfaas + Theta_pd-p) / Theta_pd-d); 0 balanced."""
    prefill, decode = rates[0] + rates[1], rates[2]
    if prefill <= 0 or decode <= 0:
        return math.inf if decode <= 0 < prefill else -math.inf if prefill <= 0 < decode else 0.0
    return math.log(prefill / decode)


class RoleBalancer:
    """The long-term loop of `prfaas-dynamic`: convert PD workers between prefill and decode.

    Paper section 3.4.3: "When Theta_prfaas + Theta_pd-p << Theta_pd-d, prefill is the system
    bottleneck, and when ... >> Theta_pd-d, decode is"; the scheduler "monitors queue depth and
    utilization at each stage", "periodically re-evaluates load balance and converts nodes between
    prefill and decode roles within the PD cluster" (Eq. 8). At the end of each period:

    1. Re-estimate the three rates for the current shape: the throughput model (Eqs. 3-5: the
       hardware profiles, the recent incremental lengths, the current t), except that a stage
       whose queue stayed backed up the whole period (mean queue per worker >= `min_backlog`)
       delivered exactly its capacity, so its measured completions per second replace the model.
    2. Queue evidence first: the stage whose mean queue per worker is `imbalance` times the
       other's (and >= `min_backlog`) is the bottleneck.
    3. Else Eq. 8, while the busiest stage is at least `min_load` loaded at the measured
       arrival rate: prefill (Theta_prfaas + Theta_pd-p) below Theta_pd-d / (1 + margin) makes
       prefill the bottleneck, above Theta_pd-d * (1 + margin) decode; such a conversion is made
       only if it brings Eq. 8 closer to balance (one worker's rate moves from one side to the
       other), and never away from a stage that is backed up. Under a light load the shape
       limits nothing: the deployed split is kept, with its headroom for a burst.
    4. The bottleneck gains the least loaded worker of the other role (the router drains it
       first); the policy then re-solves t for the new shape.
    5. Only when the period before wanted the same (one period's evidence may be a burst or
       the warm-up), and unless it would undo the last conversion within `cooldown_s`
       (flapping), or the shape
       it leaves would not carry the load measured now (both PD stages within `max_load`: the
       role given away must still take its share; without traffic, nothing is converted: the
       loop settles).

    It accumulates stage queues and completions over a period; at its end, at most one
    `ConvertWorker`, the second period in a row that wants it. `estimate` gives the model's
    rates for a shape.
    """

    def __init__(self, config: RoleConfig, estimate: Estimator | None = None,
                 loads: Loads | None = None, max_load: float = 1.0) -> None:
        """`estimate`: the model's stage rates for a shape; `loads`: each stage's load for a
        shape at the arrival rate measured now (None without traffic: no conversion);
        `max_load`: the most a PD stage may be loaded in the shape a conversion leaves."""
        self.config = config
        self._estimate = estimate
        self._loads = loads
        self._max_load = max_load
        self._last: tuple[float, str] | None = None  # (when, to_role) of the last conversion
        self._wanted: str | None = None  # the role the last period wanted a worker moved to
        self._period_start: float | None = None
        self._prefill_sum = self._decode_sum = self._prfaas_sum = 0.0
        self._samples = 0
        self._done = [0, 0, 0]  # completions this period: PrfaaS prefill, PD prefill, decode
        self._pending: ConvertWorker | None = None
        self.conversions = 0
        self.last_rates: Rates | None = None  # the estimate of the last period's end

    def finished(self, cluster: str) -> None:
        """A request finished: its prefill stage and the decode stage each served one."""
        self._done[0 if cluster == "prfaas" else 1] += 1
        self._done[2] += 1

    def tick(self, now: float, state: ClusterState) -> ConvertWorker | None:
        if not self.config.enabled:
            return None
        if self._period_start is None:
            self._period_start = now
        prefill, decode = state.select("pd", "prefill"), state.select("pd", "decode")
        self._prefill_sum += _mean_queue(prefill)
        self._decode_sum += _mean_queue(decode)
        self._prfaas_sum += _mean_queue(state.select("prfaas", "prefill"))
        self._samples += 1
        elapsed = now - self._period_start
        if elapsed < self.config.period_s:
            return None
        n = self._samples
        means = (self._prfaas_sum / n, self._prefill_sum / n, self._decode_sum / n)
        rates = self._rates(shape_of(state), means, [d / elapsed for d in self._done])
        self._period_start, self._samples, self._done = now, 0, [0, 0, 0]
        self._prefill_sum = self._decode_sum = self._prfaas_sum = 0.0
        if state.select("pd", "draining"):
            return None
        action = self._rebalance(means[1], means[2], prefill, decode, rates,
                                 self._busy(shape_of(state)))
        wanted, self._wanted = self._wanted, action.to_role if action else None
        if action is None or wanted != action.to_role or not self._allowed(now, state, action):
            return None
        self._wanted = None
        return self._issue(now, action)

    def _allowed(self, now: float, state: ClusterState, action: ConvertWorker) -> bool:
        """Step 5 of the class docstring: not undoing the last conversion within
        `cooldown_s`, and only to a shape that carries the load measured now."""
        last = self._last
        if last is not None and last[1] != action.to_role and \
                now - last[0] < self.config.cooldown_s:
            return False
        if self._loads is None:
            return True
        loads = self._loads(self.shape_after(shape_of(state), action))
        return loads is not None and max(loads[1], loads[2]) <= self._max_load

    def _busy(self, shape: ClusterShape) -> bool:
        """Whether the busiest stage is at least `min_load` loaded (step 3's gate)."""
        loads = self._loads(shape) if self._loads is not None else (1.0, 1.0, 1.0)
        return loads is not None and max(loads) >= self.config.min_load

    def _rates(self, shape: ClusterShape, queues: tuple[float, float, float],
               measured: list[float]) -> Rates | None:
        """Step 1 of the class docstring: the model's rates, measured where backed up."""
        if self._estimate is None:
            return None
        model = self._estimate(shape)
        rates = tuple(measured[i] if queues[i] >= self.config.min_backlog and measured[i] > 0
                      else model[i] for i in range(3))
        self.last_rates = (rates[0], rates[1], rates[2])
        return self.last_rates

    def _rebalance(self, pre: float, dec: float, prefill: list[WorkerSnapshot],
                   decode: list[WorkerSnapshot], rates: Rates | None,
                   busy: bool) -> ConvertWorker | None:
        cfg = self.config
        stats = (f"mean queue per worker over {cfg.period_s:g} s: decode {dec:.1f}, "
                 f"PD prefill {pre:.1f}")
        backed = (pre >= cfg.min_backlog, dec >= cfg.min_backlog)
        to_decode = backed[1] and dec >= cfg.imbalance * pre
        to_prefill = backed[0] and pre >= cfg.imbalance * dec
        if rates is not None and busy and not (to_decode or to_prefill):
            to_decode, to_prefill, stats = self._eq8(rates, len(prefill), len(decode), backed)
        if to_decode and len(prefill) > cfg.min_role_workers:
            return ConvertWorker(
                worker=_least_loaded(prefill).name, from_role="prefill", to_role="decode",
                reason=f"long-term: decode is the bottleneck ({stats})")
        if to_prefill and len(decode) > cfg.min_role_workers:
            return ConvertWorker(
                worker=_least_loaded(decode).name, from_role="decode", to_role="prefill",
                reason=f"long-term: prefill is the bottleneck ({stats})")
        return None

    def _eq8(self, rates: Rates, n_p: int, n_d: int,
             backed: tuple[bool, bool]) -> tuple[bool, bool, str]:
        """Step 3: (to decode, to prefill, why) from Eq. 8 with one worker moved."""
        gap, limit = eq8_gap(rates), math.log1p(self.config.margin)
        per_p = rates[1] / n_p if n_p else 0.0
        per_d = rates[2] / n_d if n_d else 0.0
        stats = (f"Eq. 8: Theta_prfaas + Theta_pd-p = {rates[0]:.3g} + {rates[1]:.3g} vs "
                 f"Theta_pd-d = {rates[2]:.3g} req/s")
        to_decode = gap > limit and not backed[0] and abs(eq8_gap(
            (rates[0], rates[1] - per_p, rates[2] + per_d))) < abs(gap)
        to_prefill = gap < -limit and not backed[1] and abs(eq8_gap(
            (rates[0], rates[1] + per_p, rates[2] - per_d))) < abs(gap)
        return to_decode, to_prefill, stats

    def _issue(self, now: float, action: ConvertWorker) -> ConvertWorker:
        self.conversions += 1
        self._pending = action
        self._last = (now, action.to_role)
        return action

    def expected_shape(self, state: ClusterState) -> ClusterShape:
        """The shape once the last conversion is done, while the router still carries it out
        (the worker shows its old role, then "draining"); t is solved for this shape."""
        shape = shape_of(state)
        pending = self._pending
        role = next((w.role for w in state.workers if pending and w.name == pending.worker), None)
        if pending is None or role is None or role == pending.to_role:
            self._pending = None
            return shape
        if role == pending.from_role:
            return self.shape_after(shape, pending)
        grow = 1 if pending.to_role == "prefill" else 0
        return ClusterShape(shape.n_prfaas, shape.n_p + grow, shape.n_d + 1 - grow)

    @staticmethod
    def shape_after(shape: ClusterShape, action: ConvertWorker) -> ClusterShape:
        """The shape once `action` is done (what t is re-solved for)."""
        delta = 1 if action.to_role == "prefill" else -1
        return ClusterShape(shape.n_prfaas, shape.n_p + delta, shape.n_d - delta)
