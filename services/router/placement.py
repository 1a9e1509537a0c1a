"""Worker choice inside a cluster: cache-affine first, then least loaded.

The paper leaves decode-node choice open (docs/paper-notes.md section 2.4, "Not specified") and
picks
"the cache-affine node" for prefill (section 3.2). Rule, for either role:
1. candidates are the workers of that role (a draining worker takes nothing new); a worker at
   its `capacity` is skipped unless every one is;
2. affinity is allowed only among workers whose load (queue + running) is at most the least
   load plus `max_affinity_excess`: the load cap, so a hot prefix cannot pile every request
   onto one worker (SGLang's cache-aware router has the same guard: above a load imbalance it
   goes least loaded; docs/prior-work.md section 7);
3. among those, the longest cached prefix wins; ties go to the least loaded, then by name.
For decode the cached prefix is what the worker *holds* (any held KV block saves a transfer);
for prefill it is what it can *resume from* (services/cachedir/directory.py, blocks_resumable).
`choose_worker_reference` is the same rule as a plain sort, for the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.contract.types import WorkerRole
from services.router.policy import PolicyError


class PlacementError(PolicyError):
    """No worker of the required role to choose from."""


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: WorkerRole
    cached_prefix_tokens: int = 0  # of this request's prompt, on this worker
    running: int = 0
    queue: int = 0
    capacity: int | None = None  # most requests it should hold (decode: BS_max); None: no cap

    @property
    def load(self) -> int:
        return self.running + self.queue

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.load >= self.capacity


class PlacementConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # How much busier than the least loaded worker a cache-affine worker may be. 4 requests:
    # a decode batch of BS_max = 20 (paper-derived, services/paper/hardware.py) absorbs that much
    # skew, while a hot prefix spreads once one worker runs 4 ahead.
    max_affinity_excess: int = 4

    def __post_init__(self) -> None:
        if self.max_affinity_excess < 0:
            raise PolicyError(f"max_affinity_excess must be >= 0, got "
                              f"{self.max_affinity_excess!r}")


DEFAULT_PLACEMENT = PlacementConfig()


def _eligible(candidates: Sequence[WorkerLoad], role: WorkerRole) -> list[WorkerLoad]:
    workers = [w for w in candidates if w.role == role]
    if not workers:
        names = ", ".join(f"{w.name} ({w.role})" for w in candidates) or "none"
        raise PlacementError(f"no {role} worker among candidates: {names}")
    open_workers = [w for w in workers if not w.full]
    return open_workers or workers


def choose_worker(candidates: Sequence[WorkerLoad], role: WorkerRole,
                  config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The chosen worker's name (rule in the module docstring), in one pass."""
    workers = _eligible(candidates, role)
    cap = min(w.load for w in workers) + config.max_affinity_excess
    best: WorkerLoad | None = None
    for w in workers:
        if w.load <= cap and (best is None or (-w.cached_prefix_tokens, w.load, w.name)
                              < (-best.cached_prefix_tokens, best.load, best.name)):
            best = w
    assert best is not None
    return best.name


def choose_worker_reference(candidates: Sequence[WorkerLoad], role: WorkerRole,
                            config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """Slow, obvious reference: filter step by step, then sort by the whole key."""
    of_role = [w for w in candidates if w.role == role]
    if not of_role:
        raise PlacementError(f"no {role} worker among candidates")
    not_full = [w for w in of_role if not w.full] or of_role
    least = sorted(w.load for w in not_full)[0]
    allowed = [w for w in not_full if w.load - least <= config.max_affinity_excess]
    ranked = sorted(allowed, key=lambda w: w.name)
    ranked = sorted(ranked, key=lambda w: w.load)
    ranked = sorted(ranked, key=lambda w: w.cached_prefix_tokens, reverse=True)
    return ranked[0].name


def choose_decode_worker(candidates: Sequence[WorkerLoad],
                         config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The decode worker for a request (candidates: the PD cluster's workers)."""
    return choose_worker(candidates, "decode", config)


def choose_prefill_worker(candidates: Sequence[WorkerLoad],
                          config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The prefill worker in the chosen cluster (candidates: that cluster's workers)."""
    return choose_worker(candidates, "prefill", config)
