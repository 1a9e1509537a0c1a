"""Handler pools: where a node's requests wait (a bounded mailbox) and run (handler slots).

Every request goes to the node's shared pool unless its handler was registered with a pool of
its own (`slots=N` on `Node.handles`, `serves_stream` or `accepts_stream`). A request that waits
for another one to arrive (a stream that waits for an upload, say) must not hold the slot that
other request needs: give the one waited on, or the waiting kind, a pool of its own, and
neither can fill the other's slots. Each pool has its own worker tasks, one per slot.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

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

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.name, self.mailbox.statistics(), self.slots.statistics())

    def check_integrity(self) -> None:
        self.mailbox.check_integrity()
        self.slots.check_integrity()
