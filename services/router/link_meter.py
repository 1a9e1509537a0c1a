"""How much a link can carry now, estimated from what its senders see of their own transfers.

No router across a WAN is told the line's rate, and what is available moves (other tenants,
a degraded path). What the router can see is its own traffic: every status poll brings each
prefill worker's cumulative KV bytes handed to the transport and the time some send of it
waited (services/worker/send_meter.py). Over a sliding window of `window_s`:

- throughput = 8 * bytes sent by the link's senders / window;
- held = the largest share of the window during which one sender had a send waiting.

A window in which a sender was held most of the time (`held >= held_min`) is *saturated*: the
link carried all it could, so its throughput is a measurement of the available bandwidth. (One
sender is not held while it computes its next prompt even when the link is full of the other
senders' KV, so "most", not "all": 0.7.) The estimate is the mean of the saturated samples of
the last `max_age_s` (a windowed estimate, as TCP BBR keeps its bottleneck bandwidth; the mean,
not BBR's maximum, since a sample counts the KV of whole prefills and so is lumpy both ways),
so it follows a drop within `window_s + max_age_s`.
A window that was not saturated only bounds the bandwidth from below: the estimate rises to its
throughput if that is higher. Since such windows cannot show a rise of the line (the senders
were not asking for more), the estimate is probed upward by `probe_step` every `probe_s` while
traffic flows unsaturated, up to the provisioned rate (an operator knows what the line was
bought at; without one, the highest estimate so far); a saturated window ends the probe at the
measured rate. Idle windows (no byte sent) change nothing: silence says nothing of the line.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import msgspec

from services.contract.messages import WorkerState


class EstimatorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The estimator's constants (module docstring). The window spans several prefills' KV at
    the lowest rate of interest, so that one prefill's bytes do not swing a sample; a
    saturated sample stands for one and a half windows; probing from an idle link multiplies
    the estimate by 1.5 every 5 s (5 to 100 Gbps in under 40 s), and not at all while the
    senders were held a tenth of the window or more (the link is busy: nothing to learn)."""

    window_s: float = 10.0
    held_min: float = 0.7
    max_age_s: float = 15.0
    probe_s: float = 5.0
    probe_step: float = 1.5
    probe_below: float = 0.25
    provisioned_bps: float = 0.0  # the line's bought rate: the prior and the ceiling; 0 unknown

    def __post_init__(self) -> None:
        for name in ("window_s", "max_age_s", "probe_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got "
                                 f"{getattr(self, name)!r}")
        for name in ("held_min", "probe_below"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)!r}")
        if not self.probe_step > 1.0:
            raise ValueError(f"probe_step must be > 1, got {self.probe_step!r}")
        if not (math.isfinite(self.provisioned_bps) and self.provisioned_bps >= 0):
            raise ValueError(f"provisioned_bps must be >= 0, got {self.provisioned_bps!r}")


class LinkEstimate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One link as its senders see it at `now` (module docstring)."""

    now: float
    link: str = ""
    throughput_bps: float = 0.0  # sent over the last window
    available_bps: float = 0.0  # the estimate; 0: nothing measured yet and no provisioned rate
    held: float = 0.0  # share of the window some sender waited (0..1)
    saturated: bool = False
    provisioned_bps: float = 0.0  # the line's bought rate as configured (0: not given)

    @property
    def utilisation(self) -> float:
        """Throughput over the estimate (0 while the estimate is unknown)."""
        return self.throughput_bps / self.available_bps if self.available_bps > 0 else 0.0


# Per sender: (cumulative bytes, cumulative held seconds)
Readings = Mapping[str, tuple[int, float]]


def readings_of(states: Mapping[str, WorkerState | None]) -> dict[str, tuple[int, float]]:
    """The senders' counters from their last status reports (none yet: left out)."""
    return {name: (s.kv_sent_bytes, s.kv_held_s) for name, s in states.items() if s is not None}


class BandwidthEstimator:
    """One link's available bandwidth from its senders' counters (module docstring)."""

    def __init__(self, config: EstimatorConfig | None = None, link: str = "") -> None:
        self.config = config or EstimatorConfig()
        self.link = link
        self._history: deque[tuple[float, dict[str, tuple[int, float]]]] = deque()
        self._saturated: deque[tuple[float, float]] = deque()  # (when, throughput)
        self._value = self.config.provisioned_bps
        self._ceiling = self.config.provisioned_bps
        self._last_saturated = self._last_probe = -math.inf
        self.last = LinkEstimate(now=0.0, link=link, available_bps=self._value,
                                 provisioned_bps=self.config.provisioned_bps)

    @property
    def available_bps(self) -> float:
        return self._value

    def observe(self, now: float, readings: Readings) -> LinkEstimate:
        """Takes the senders' counters at `now`; the estimate after them."""
        self._history.append((now, dict(readings)))
        window = self._window(now)
        if window is None:
            return self._publish(now, 0.0, 0.0, False)
        sent, held, span = window
        throughput = 8.0 * sent / span
        # Held throughout a whole window with nothing delivered: the link carries nothing.
        stuck = sent == 0 and held >= self.config.held_min and span >= self.config.window_s
        saturated = (sent > 0 or stuck) and held >= self.config.held_min
        if saturated:
            self._measured(now, throughput)
        elif sent > 0:
            self._unsaturated(now, throughput, held)
        return self._publish(now, throughput, held, saturated)

    def _window(self, now: float) -> tuple[int, float, float] | None:
        """(bytes, held share, seconds) between the oldest reading within `window_s` and now;
        None while the readings span less than half a window."""
        history, horizon = self._history, now - self.config.window_s
        while len(history) > 1 and history[1][0] <= horizon:
            history.popleft()
        then, old = history[0]
        span = now - then
        if span < self.config.window_s / 2:
            return None
        current = history[-1][1]
        sent, held = 0, 0.0
        for name, (nbytes, held_s) in current.items():
            # A sender that restarted counts from zero again.
            before = old.get(name, (0, 0.0))
            restarted = nbytes < before[0] or held_s < before[1]
            base = (0, 0.0) if restarted else before
            sent += nbytes - base[0]
            held = max(held, (held_s - base[1]) / span)
        return sent, min(held, 1.0), span

    def _measured(self, now: float, throughput: float) -> None:
        """A saturated window: its throughput is what the link carries now."""
        samples = self._saturated
        samples.append((now, throughput))
        while samples and samples[0][0] < now - self.config.max_age_s:
            samples.popleft()
        # At least a bit a second: a link measured to carry nothing is known, not unknown (0).
        self._value = max(sum(rate for _, rate in samples) / len(samples), 1.0)
        self._ceiling = max(self._ceiling, self._value)
        self._last_saturated = now

    def _unsaturated(self, now: float, throughput: float, held: float) -> None:
        """Traffic flowed, not saturating: a lower bound, and a probe upward every `probe_s`
        while the senders were held less than `probe_below` of the window, by a step that
        shrinks from `probe_step` (never held) to none (held `probe_below`)."""
        cfg = self.config
        if throughput > self._value:
            self._value = throughput
            self._ceiling = max(self._ceiling, throughput)
            return
        slack = 1.0 - held / cfg.probe_below
        if slack <= 0 or now - max(self._last_saturated, self._last_probe) < cfg.probe_s:
            return
        self._last_probe = now
        self._saturated.clear()
        step = 1.0 + (cfg.probe_step - 1.0) * slack
        self._value = min(self._value * step, max(self._ceiling, self._value))

    def _publish(self, now: float, throughput: float, held: float,
                 saturated: bool) -> LinkEstimate:
        self.last = LinkEstimate(now=now, link=self.link, throughput_bps=throughput,
                                 available_bps=self._value, held=held, saturated=saturated,
                                 provisioned_bps=self.config.provisioned_bps)
        return self.last

    def check_integrity(self) -> None:
        if not (math.isfinite(self._value) and self._value >= 0):
            raise AssertionError(f"estimate {self._value!r} is not a finite number >= 0")
        if self._ceiling and self._value > self._ceiling * (1 + 1e-9):
            raise AssertionError(f"estimate {self._value} above its ceiling {self._ceiling}")
