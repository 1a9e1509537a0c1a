"""What a sender sees of its own KV transfers: the bytes the decode workers accepted, and for
how long its KV was held back.

A prefill streams each layer's KV as the compute produces it, so while the link keeps up, a
job's KV has crossed a moment after its compute ends. KV still crossing after the compute
means the bytes ahead of it have not left: the link (or the receiver) is the bottleneck, not
the compute. `held_s` counts the time during which at least one job of this worker had ended
its compute while its KV was not yet all accepted by the decode worker: a duration, at most
the wall time, whatever the number of jobs waiting at once. Both counts are cumulative over
the worker's life, so a reader that polls now and then (the router, at every status poll)
takes differences over any window it likes.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class SendReading(msgspec.Struct, frozen=True, gc=False):
    """The meter at one instant (cumulative since the worker started)."""

    sent_bytes: int
    held_s: float


class SendMeter:
    """Counts KV bytes accepted by the receivers and the time some job's KV was held back."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._waiting = 0  # jobs whose compute ended and whose KV is still crossing
        self._since = 0.0  # when the first of them began to wait
        self._held_s = 0.0  # closed spans with a job waiting
        self._bytes = 0

    def delivered(self, nbytes: int) -> None:
        """A job's `nbytes` of KV were all accepted by the decode worker."""
        self._bytes += nbytes

    def waiting(self) -> None:
        """A job's compute ended; its KV is still crossing (each is followed by `crossed`)."""
        if self._waiting == 0:
            self._since = self._clock()
        self._waiting += 1

    def crossed(self) -> None:
        """A waiting job's KV was all accepted (or the job ended otherwise)."""
        self._waiting -= 1
        if self._waiting == 0:
            self._held_s += self._clock() - self._since

    def reading(self) -> SendReading:
        """The counts now, the span still open included."""
        held = self._held_s + (self._clock() - self._since if self._waiting else 0.0)
        return SendReading(sent_bytes=self._bytes, held_s=held)

    def check_integrity(self) -> None:
        if self._waiting < 0 or self._held_s < 0 or self._bytes < 0:
            raise AssertionError(f"send meter: {self._waiting} waiting, held {self._held_s} s, "
                                 f"{self._bytes} bytes")
