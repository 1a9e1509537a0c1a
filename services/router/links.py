"""The router's book of the links: once per tick the control loop (services/router/control.py)
has the scheduler estimate each link's bandwidth from what its senders saw of their own
transfers (services/router/link_meter.py; never the line's configured rate), and samples what
the transport tells of it (up, stalls, queued bytes); the book keeps the latest of each per
link, so that each PrfaaS cluster is judged by its own link to the request's PD cluster.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from services.router.config import LinkEnds
from services.router.link_meter import BandwidthEstimator, EstimatorConfig, LinkEstimate
from services.router.policy import LinkSample


class LinkBook:
    """The latest sample of each link, its recent stalls (over `stall_window_s`), and the
    links held back from new offload after KV stalled on them (`hold`)."""

    def __init__(self, links: Sequence[LinkEnds], stall_window_s: float,
                 estimator: EstimatorConfig | None = None) -> None:
        self._ends = {(e.a, e.b): e.name for e in links}
        self._ends.update({(e.b, e.a): e.name for e in links})
        self.stall_window_s = stall_window_s
        self._estimators = {e.name: BandwidthEstimator(estimator, e.name) for e in links}
        self._samples: dict[str, LinkSample] = {}
        self._stalls: dict[str, deque[tuple[float, int]]] = {}
        self._held: dict[str, float] = {}  # link -> until when it takes no new offload

    def observe(self, sample: LinkSample) -> None:
        self._samples[sample.link] = sample
        history = self._stalls.setdefault(sample.link, deque())
        history.append((sample.now, sample.stalls))
        while history and history[0][0] < sample.now - self.stall_window_s:
            history.popleft()

    def measure(self, name: str, now: float,
                readings: Mapping[str, tuple[int, float]]) -> LinkEstimate:
        """Link `name`'s estimate after its senders' counters at `now` (link_meter.py)."""
        return self._estimators[name].observe(now, readings)

    def estimate(self, name: str) -> LinkEstimate | None:
        estimator = self._estimators.get(name)
        return estimator.last if estimator is not None else None

    def estimates(self) -> dict[str, LinkEstimate]:
        """Every link's latest estimate, by name."""
        return {name: e.last for name, e in self._estimators.items()}

    def wire_time(self, name: str, nbytes: int) -> float:
        """Seconds `nbytes` take to cross link `name` at its estimated bandwidth (0 while it
        has no estimate, or for a link not in the topology)."""
        estimate = self.estimate(name)
        if estimate is None or estimate.available_bps <= 0:
            return 0.0
        return 8.0 * nbytes / estimate.available_bps

    def utilisation(self, a: str, b: str) -> float:
        """The link between a and b: its senders' throughput over its estimated bandwidth."""
        estimate = self.estimate(self.between(a, b))
        return estimate.utilisation if estimate is not None else 0.0

    def between(self, a: str, b: str) -> str:
        """The name of the link joining clusters a and b ("" when none is known)."""
        return self._ends.get((a, b), "")

    def sample(self, a: str, b: str) -> LinkSample | None:
        """The latest sample of the link between a and b; an unnamed sample stands for any."""
        name = self.between(a, b)
        return self._samples.get(name) or self._samples.get("")

    def hold(self, a: str, b: str, until: float) -> None:
        """KV stalled on the link between a and b: it takes no new offload until `until`."""
        self.hold_link(self.between(a, b), until)

    def hold_link(self, name: str, until: float) -> None:
        self._held[name] = max(until, self._held.get(name, until))

    def held(self, a: str, b: str, now: float) -> bool:
        return self._held.get(self.between(a, b), now) > now

    def recent_stalls(self, a: str, b: str) -> int:
        name = self.between(a, b)
        history = self._stalls.get(name) or self._stalls.get("")
        return history[-1][1] - history[0][1] if history else 0
