"""Deadlines: absolute times on anyio's clock (virtual under trio's MockClock).

Two tools. `deadline_scope` is a cancel scope that turns its expiry into `DeadlineExceeded`;
it is used where a task may block for long (dialling, waiting for room to send). `DeadlineWatch`
serves the hot path: a waiting caller registers its reply mailbox once and the watch task
fails it with `DeadlineExceeded` when its time comes. A cancel scope costs about as much as a
whole socket write on a small host (docs/engineering-notes.md 3d), so calls and stream items
carry none: one watch task per node sleeps until the earliest deadline instead (on a
`mesh.native.Alarm`, which an earlier deadline moves without waking it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import anyio

from mesh import native
from mesh.errors import DeadlineExceeded, MeshError
from mesh.native import Alarm
from mesh.wire import wire_timeout


class Expiring(Protocol):
    """A wait the watch can fail: a reply Mailbox, or a client's PendingCall."""

    @property
    def open(self) -> bool: ...

    def fail(self, error: MeshError) -> None: ...


class deadline_scope:
    """Runs the body until `deadline`, then raises DeadlineExceeded naming `what`."""

    __slots__ = ("_on_expiry", "_scope", "_what")

    def __init__(
        self, deadline: float, what: str, on_expiry: Callable[[], None] | None = None
    ) -> None:
        self._scope = anyio.CancelScope(deadline=deadline)
        self._what = what
        self._on_expiry = on_expiry

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The scope swallows only its own cancellation, which becomes DeadlineExceeded here.
        self._scope.__exit__(kind, exc, tb)
        if self._scope.cancelled_caught:
            if self._on_expiry is not None:
                self._on_expiry()
            raise DeadlineExceeded(f"{self._what}: deadline passed") from None


def relative_timeout(deadline: float) -> float | None:
    """Seconds left until `deadline`, as sent on the wire (None for none or beyond the cap)."""
    return None if math.isinf(deadline) else wire_timeout(deadline - native.clock()())


class DeadlineWatch:
    """Fails registered mailboxes with DeadlineExceeded when their deadline passes."""

    def __init__(self, on_expiry: Callable[[], None] | None = None) -> None:
        self.expired = 0
        # Times the watch task has woken (tests: it sleeps past finished waits).
        self.wake_ups = 0
        self._on_expiry = on_expiry
        self._heap: list[tuple[float, int, Expiring, str]] = []
        self._order = itertools.count()
        self._next_wake = math.inf
        self._alarm = Alarm()
        self._compact_above = 1024

    def watch(self, deadline: float, mailbox: Expiring, what: str) -> None:
        """Fails `mailbox` at `deadline` unless it is closed or ended by then."""
        if deadline == math.inf:
            return
        heapq.heappush(self._heap, (deadline, next(self._order), mailbox, what))
        if deadline < self._next_wake:
            # The watch sleeps until the earliest deadline: bring its wake-up forward to this
            # one (no wake-up now only to go back to sleep until then).
            self._next_wake = deadline
            self._alarm.move(deadline)
        if len(self._heap) > self._compact_above:
            self._compact()

    def check_integrity(self) -> None:
        """Asserts the heap order (tests call it after each operation)."""
        heap = self._heap
        for child in range(1, len(heap)):
            assert heap[(child - 1) // 2][:2] <= heap[child][:2], "deadline heap out of order"

    async def run(self) -> None:
        """The watch task: sleeps until the earliest deadline (or an earlier one arrives)."""
        clock = native.clock()
        while True:
            self._expire(clock())
            self._drop_finished()
            self._next_wake = self._heap[0][0] if self._heap else math.inf
            await self._alarm.sleep_until(self._next_wake)
            self.wake_ups += 1

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, mailbox, what = heapq.heappop(self._heap)
            if mailbox.open:
                self.expired += 1
                mailbox.fail(DeadlineExceeded(f"{what}: deadline passed"))
                if self._on_expiry is not None:
                    self._on_expiry()

    def _drop_finished(self) -> None:
        # Waits answered before their deadline stay in the heap; those on top would each
        # wake the watch at an instant with nothing to fail (most calls finish in time).
        heap = self._heap
        while heap and not heap[0][2].open:
            heapq.heappop(heap)

    def _compact(self) -> None:
        # Finished waits stay in the heap until their deadline; sweep them out whenever the
        # heap has doubled since the last sweep (amortised O(1) per registration).
        self._heap = [entry for entry in self._heap if entry[2].open]
        heapq.heapify(self._heap)
        self._compact_above = max(1024, 2 * len(self._heap))
