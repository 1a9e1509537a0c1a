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
3. Else Eq. 8: prefill (Theta_prfaas + Theta_pd-p) below Theta_pd-d / (1 + margin) makes
   prefill the bottleneck, above Theta_pd-d * (1 + margin) decode; such a conversion is made
   only if it brings Eq. 8 closer to balance (one worker's rate moves from one side to the
   other), and never away from a stage that is backed up.
4. The bottleneck gains the least loaded worker of the other role (the router drains it
   first); the policy then re-solves t for the new shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from services.paper.planner import ClusterShape
from services.router.policy import ClusterState, ConvertWorker, PolicyError, WorkerState

# The model's (Theta_prfaas, Theta_pd-p, Theta_pd-d) in requests/s for a shape
Rates = tuple[float, float, float]
Estimator = Callable[[ClusterShape], Rates]


class RoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    period_s: float = 60.0
    imbalance: float = 2.0
    min_backlog: float = 2.0  # mean queued requests per worker before a stage counts as backed up
    min_role_workers: int = 1  # never convert the last worker(s) of a role
    margin: float = 0.3  # Eq. 8 may be off by this fraction before a conversion

    def __post_init__(self) -> None:
        for name in ("period_s", "imbalance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PolicyError(f"roles.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.min_backlog) and self.min_backlog >= 0):
            raise PolicyError(f"roles.min_backlog must be >= 0, got {self.min_backlog!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise PolicyError(f"roles.margin must be >= 0, got {self.margin!r}")
        if self.min_role_workers < 1:
            raise PolicyError(f"roles.min_role_workers must be >= 1, got "
                              f"{self.min_role_workers!r}")


def shape_of(state: ClusterState) -> ClusterShape:
    """Serving instances per stage; draining workers count for neither role."""
    return ClusterShape(len(state.select("prfaas", "prefill")),
                        len(state.select("pd", "prefill")), len(state.select("pd", "decode")))


def _mean_queue(workers: list[WorkerState]) -> float:
    return sum(w.queue for w in workers) / len(workers) if workers else 0.0


def _least_loaded(workers: list[WorkerState]) -> WorkerState:
    return min(workers, key=lambda w: (w.load, w.name))


def eq8_gap(rates: Rates) -> float:
    """How far Eq. 8 is off: log((Theta_prfaas + Theta_pd-p) / Theta_pd-d); 0 balanced."""
    prefill, decode = rates[0] + rates[1], rates[2]
    if prefill <= 0 or decode <= 0:
        return math.inf if decode <= 0 < prefill else -math.inf if prefill <= 0 < decode else 0.0
    return math.log(prefill / decode)


class RoleBalancer:
    """Accumulates stage queues and completions over a period; at its end, at most one
    `ConvertWorker` (module docstring). `estimate` gives the model's rates for a shape."""

    def __init__(self, config: RoleConfig, estimate: Estimator | None = None) -> None:
        self.config = config
        self._estimate = estimate
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
        return self._rebalance(means[1], means[2], prefill, decode, rates)

    def _rates(self, shape: ClusterShape, queues: tuple[float, float, float],
               measured: list[float]) -> Rates | None:
        """Step 1 of the module docstring: the model's rates, measured where backed up."""
        if self._estimate is None:
            return None
        model = self._estimate(shape)
        rates = tuple(measured[i] if queues[i] >= self.config.min_backlog and measured[i] > 0
                      else model[i] for i in range(3))
        self.last_rates = (rates[0], rates[1], rates[2])
        return self.last_rates

    def _rebalance(self, pre: float, dec: float, prefill: list[WorkerState],
                   decode: list[WorkerState], rates: Rates | None) -> ConvertWorker | None:
        cfg = self.config
        stats = (f"mean queue per worker over {cfg.period_s:g} s: decode {dec:.1f}, "
                 f"PD prefill {pre:.1f}")
        backed = (pre >= cfg.min_backlog, dec >= cfg.min_backlog)
        to_decode = backed[1] and dec >= cfg.imbalance * pre
        to_prefill = backed[0] and pre >= cfg.imbalance * dec
        if rates is not None and not (to_decode or to_prefill):
            to_decode, to_prefill, stats = self._eq8(rates, len(prefill), len(decode), backed)
        if to_decode and len(prefill) > cfg.min_role_workers:
            return self._issue(ConvertWorker(
                worker=_least_loaded(prefill).name, from_role="prefill", to_role="decode",
                reason=f"long-term: decode is the bottleneck ({stats})"))
        if to_prefill and len(decode) > cfg.min_role_workers:
            return self._issue(ConvertWorker(
                worker=_least_loaded(decode).name, from_role="decode", to_role="prefill",
                reason=f"long-term: prefill is the bottleneck ({stats})"))
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

    def _issue(self, action: ConvertWorker) -> ConvertWorker:
        self.conversions += 1
        self._pending = action
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
