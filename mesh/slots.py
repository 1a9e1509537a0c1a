"""Handler slots: the bound on how many of a node's handlers run at once.

Handlers start in two places (mesh.server): in a connection's reader task (the fast path) and
in the node's worker tasks (requests that went through the mailbox). Both take a slot first,
so `NodeConfig.max_concurrency` bounds them together, and 1 still means one handler at a time.
A slot freed while workers wait for one goes straight to the longest waiting worker, so a
newly read request cannot overtake requests taken from the mailbox before it.
"""

from __future__ import annotations

from collections import deque

import anyio
import msgspec

from mesh.errors import ConfigError


class SlotStatistics(msgspec.Struct, frozen=True):
    """Slots in use now, the bound, the most ever in use, and tasks waiting for one."""

    busy: int
    capacity: int
    high_water: int
    waiting: int


class Slots:
    """A counting bound with FIFO hand-over; `try_take` never waits."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._busy = 0
        self._high_water = 0
        self._waiters: deque[anyio.Event] = deque()

    def try_take(self) -> bool:
        """Takes a slot if one is free and nobody waits for one."""
        if self._busy >= self._capacity or self._waiters:
            return False
        self._busy += 1
        if self._busy > self._high_water:
            self._high_water = self._busy
        return True

    async def take(self) -> None:
        """Takes a slot, waiting (in FIFO order) while none is free."""
        if self.try_take():
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():
                # We were handed a slot we will not use: pass it on.
                self.give()
            else:
                self._waiters.remove(event)
            raise

    def give(self) -> None:
        """Frees a slot, handing it straight to the first waiter if there is one."""
        if self._waiters:
            self._waiters.popleft().set()
        else:
            self._busy -= 1

    def check_integrity(self) -> None:
        """Asserts the counts (tests call it after each operation)."""
        assert 0 <= self._busy <= self._capacity, "slots in use out of range"
        assert not self._waiters or self._busy == self._capacity, "waiting beside a free slot"
        assert self._high_water <= self._capacity

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            busy=self._busy,
            capacity=self._capacity,
            high_water=self._high_water,
            waiting=len(self._waiters),
        )
