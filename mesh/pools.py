"""Handler pools: where a node's requests wait (a bounded mailbox) and run (handler slots).

Every request goes to the node's shared pool unless its handler was registered with a pool of
its own (`slots=N` on `Node.handles`, `serves_stream` or `accepts_stream`). A request that waits
for another one to arrive (a stream that waits for an upload, say) must not hold the slot that
other request needs: give the one waited on, or the waiting kind, a pool of its own, and
neither can fill the other's slots. Each pool has its own worker tasks, at most one per slot,
started as requests arrive that no idle worker would take (`Pool.put`): a worker's pool of 512
stream slots costs 512 tasks only once it has had 512 streams at once, not from its start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from mesh.errors import ConfigError
from mesh.mailbox import Mailbox, MailboxStatistics
from mesh.slots import Slots, SlotStatistics

T = TypeVar("T")


class PoolStatistics(msgspec.Struct, frozen=True):
    """One pool: the message types it serves ("" for the shared pool), queue and slots."""

    name: str
    mailbox: MailboxStatistics
    handlers: SlotStatistics


class Pool(Generic[T]):
    """A bounded mailbox and `capacity` handler slots."""

    def __init__(self, name: str, mailbox_size: int, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.mailbox: Mailbox[T] = Mailbox(mailbox_size)
        self.slots = Slots(capacity)
        self.workers = 0  # worker tasks started
        self._starting = 0  # started, not yet waiting on the mailbox
        self._start: Callable[[], object] | None = None

    def run_workers(self, start: Callable[[], object] | None) -> None:
        """`start()` starts one worker task (None: the node stopped). Workers start as
        requests arrive (`put`), each calling `worker_ready` when it begins."""
        self._start = start
        self.workers = self._starting = 0
        self._more_workers()

    def worker_ready(self) -> None:
        self._starting -= 1

    async def put(self, item: T) -> bool:
        """Queues `item` (waiting for room), and starts a worker if no idle or starting
        one will take it; False (dropped) once the mailbox has ended or been closed."""
        queued = await self.mailbox.put(item)
        self._more_workers()
        return queued

    def put_nowait(self, item: T) -> bool:
        """`put` if the mailbox has room now (and is open); False (nothing done) if not."""
        queued = self.mailbox.put_nowait(item)
        if queued:
            self._more_workers()
        return queued

    def _more_workers(self) -> None:
        mailbox = self.mailbox
        while (self._start is not None and self.workers < self.capacity
               and mailbox.depth > mailbox.getters + self._starting):
            self.workers += 1
            self._starting += 1
            self._start()

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.name, self.mailbox.statistics(), self.slots.statistics())

    def check_integrity(self) -> None:
        self.mailbox.check_integrity()
        self.slots.check_integrity()


class Pools(Generic[T]):
    """A node's pools: the shared one, and one per message type registered with `slots`."""

    def __init__(self, mailbox_size: int, shared_capacity: int) -> None:
        self._mailbox_size = mailbox_size
        self.shared: Pool[T] = Pool("", mailbox_size, shared_capacity)
        self._own: dict[type[msgspec.Struct], Pool[T]] = {}

    def reserve(self, message: type[msgspec.Struct], slots: int | None) -> Pool[T] | None:
        """A pool of `slots` handler slots for `message` (None: it uses the shared one)."""
        check_slots(message, slots)
        if slots is None:
            return None
        pool: Pool[T] = Pool(message.__name__, self._mailbox_size, slots)
        self._own[message] = pool
        return pool

    def pool_for(self, message: type[msgspec.Struct]) -> Pool[T]:
        return self._own.get(message, self.shared)

    def all(self) -> tuple[Pool[T], ...]:
        """The shared pool first, then the reserved ones."""
        return (self.shared, *self._own.values())

    def own(self) -> tuple[Pool[T], ...]:
        return tuple(self._own.values())


def check_slots(message: type[msgspec.Struct], slots: int | None) -> None:
    if slots is not None and slots < 1:
        raise ConfigError(f"slots for {message.__name__} must be >= 1, got {slots}")
