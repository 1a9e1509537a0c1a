"""The long-term loop of `prfaas-dynamic`: convert PD workers between prefill and decode.

Paper section 3.4.3: "When Theta_prfaas + Theta_pd-p << Theta_pd-d, prefill is the system
bottleneck, and when ... >> Theta_pd-d, decode is"; the scheduler "monitors queue depth and
utilization at each stage", "periodically re-evaluates load balance and converts nodes between
prefill and decode roles within the PD cluster". We compare the measured mean queue per worker
of the two PD stages over one period; the stage whose queue is `imbalance` times the other's
(and at least `min_backlog`) is the bottleneck and gains the least loaded worker of the other.
"""

from __future__ import annotations

import math

import msgspec

from services.paper.planner import ClusterShape
from services.router.policy import ClusterState, ConvertWorker, PolicyError, WorkerState


class RoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    period_s: float = 60.0
    imbalance: float = 2.0
    min_backlog: float = 2.0  # mean queued requests per worker before a stage counts as backed up
    min_role_workers: int = 1  # never convert the last worker(s) of a role

    def __post_init__(self) -> None:
        for name in ("period_s", "imbalance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PolicyError(f"roles.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.min_backlog) and self.min_backlog >= 0):
            raise PolicyError(f"roles.min_backlog must be >= 0, got {self.min_backlog!r}")
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


class RoleBalancer:
    """Accumulates stage queues over a period; at its end, at most one `ConvertWorker`."""

    def __init__(self, config: RoleConfig) -> None:
        self.config = config
        self._period_start: float | None = None
        self._prefill_sum = self._decode_sum = 0.0
        self._samples = 0
        self._pending: ConvertWorker | None = None
        self.conversions = 0

    def tick(self, now: float, state: ClusterState) -> ConvertWorker | None:
        if not self.config.enabled:
            return None
        if self._period_start is None:
            self._period_start = now
        prefill, decode = state.select("pd", "prefill"), state.select("pd", "decode")
        self._prefill_sum += _mean_queue(prefill)
        self._decode_sum += _mean_queue(decode)
        self._samples += 1
        if now - self._period_start < self.config.period_s:
            return None
        means = (self._prefill_sum / self._samples, self._decode_sum / self._samples)
        self._period_start, self._prefill_sum, self._decode_sum, self._samples = now, 0.0, 0.0, 0
        if state.select("pd", "draining"):
            return None
        return self._rebalance(*means, prefill, decode)

    def _rebalance(self, pre: float, dec: float, prefill: list[WorkerState],
                   decode: list[WorkerState]) -> ConvertWorker | None:
        cfg = self.config
        stats = (f"mean queue per worker over {cfg.period_s:g} s: decode {dec:.1f}, "
                 f"PD prefill {pre:.1f}")
        if dec >= cfg.min_backlog and dec >= cfg.imbalance * pre and \
                len(prefill) > cfg.min_role_workers:
            return self._issue(ConvertWorker(
                worker=_least_loaded(prefill).name, from_role="prefill", to_role="decode",
                reason=f"long-term: decode is the bottleneck ({stats})"))
        if pre >= cfg.min_backlog and pre >= cfg.imbalance * dec and \
                len(decode) > cfg.min_role_workers:
            return self._issue(ConvertWorker(
                worker=_least_loaded(decode).name, from_role="decode", to_role="prefill",
                reason=f"long-term: prefill is the bottleneck ({stats})"))
        return None

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
