"""Bounded mailboxes: the queues between a connection's reader and the tasks that consume.

A `Mailbox` is a bounded FIFO that ends either normally (`end`: the consumer drains what is
queued, then sees `anyio.EndOfStream`, or the end of `async for`) or with an error (`fail`:
the consumer sees that error after the queued items). A full mailbox makes the producer wait,
which pushes back through the connection to the sending peer.

It is a deque plus one Event per waiting task (the loop's own, mesh.native) rather than an
anyio memory object stream: a hand-off that finds room (or an item) costs no trip through
the scheduler, which halves the cost of each hop on the request path.
A woken waiter that is cancelled before using its turn passes the turn on, so no wake-up is
lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import msgspec

from mesh.errors import MeshError
from mesh.native import WakeUp, new_event

T = TypeVar("T")


class MailboxStatistics(msgspec.Struct, frozen=True):
    """Queue depth now, its bound, the deepest it has been, and traffic through it."""

    depth: int
    capacity: int
    high_water: int
    put: int
    taken: int


class Mailbox(Generic[T]):
    """A bounded queue with explicit end and failure; async-iterable by its consumer."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._getters: deque[WakeUp] = deque()
        self._putters: deque[WakeUp] = deque()
        self._ended = False
        self._closed = False
        self._failure: MeshError | None = None
        self._high_water = 0
        self._put = 0
        self._consumer: Callable[[T], bool] | None = None

    async def put(self, item: T) -> bool:
        """Waits for room; False (item dropped) once the mailbox has ended or been closed.

        Not a checkpoint when there is room: callers loop around socket reads, which are.
        """
        while len(self._items) >= self._capacity and not (self._ended or self._closed):
            await self._wait(self._putters)
        return self.put_nowait(item)

    def put_nowait(self, item: T) -> bool:
        """Queues `item` if there is room now; False (item dropped) when there is none or the
        mailbox has ended or been closed. While nothing is queued, a consumer set with
        `consume_directly` is offered it first."""
        if self._ended or self._closed or len(self._items) >= self._capacity:
            return False
        consumer = self._consumer
        if consumer is not None and not self._items and consumer(item):
            self._put += 1
            return True
        self._items.append(item)
        self._put += 1
        self._high_water = max(self._high_water, len(self._items))
        _wake_one(self._getters)
        return True

    async def get(self) -> T:
        """The next item; anyio.EndOfStream after `end`, the failure after `fail`.

        Not a checkpoint when an item is queued, so a consumer drains a backlog in one go.
        """
        while not self._items:
            if self._ended or self._closed:
                if self._failure is not None:
                    raise self._failure
                raise anyio.EndOfStream
            await self._wait(self._getters)
        return self._take()

    async def wait(self) -> None:
        """Waits until an item is queued or the mailbox has ended, taking nothing; for a
        mailbox's one consumer, which takes the item later (it keeps its place, and the
        room it takes, meanwhile)."""
        while not self._items and not (self._ended or self._closed):
            await self._wait(self._getters)

    def consume_directly(self, consumer: Callable[[T], bool] | None) -> None:
        """While set (None unsets it), an item put when nothing is queued goes to `consumer`
        first, in the putting task: True, it took the item, which is never queued and wakes
        no one; False queues it as usual (and every item after it, until the queue is
        drained). For a consumer task that would only hand each item to code that does not
        block: it waits once, not once per item. `consumer` must not raise."""
        self._consumer = consumer

    async def take_each(self, take: Callable[[T], object]) -> None:
        """Hands every item to `take`, which must not block, until the end (the failure is
        raised as `get` raises it); an item put while this waits is handed over in the task
        that puts it (`consume_directly`): the consumer wakes at the end, not once per item.
        What `take` raises there is raised here (that item stays queued, and so does every
        item after it). `async for` is the reference."""
        raised: list[Exception] = []

        def offer(item: T) -> bool:
            if raised:
                return False
            try:
                take(item)
            except Exception as exc:
                # Raised in the putting task, which must not fail for the consumer: the
                # consumer raises it when it wakes for the item, left queued.
                raised.append(exc)
                return False
            return True

        self.consume_directly(offer)
        try:
            while True:
                try:
                    item = await self.get()
                except anyio.EndOfStream:
                    return
                if raised:
                    raise raised[0]
                take(item)
        finally:
            self.consume_directly(None)

    def get_nowait(self) -> T | None:
        """An item if one is queued now, else None (also at the end)."""
        return self._take() if self._items else None

    def end(self) -> None:
        """No more items: the consumer drains what is queued, then sees the end."""
        self._ended = True
        _wake_all(self._getters)
        _wake_all(self._putters)

    def fail(self, error: MeshError) -> None:
        """Ends with `error`, raised to the consumer once the queued items are drained."""
        if self._failure is None and not self._ended:
            self._failure = error
        self.end()

    def close(self) -> None:
        """The consumer leaves: queued items are discarded and later puts dropped."""
        self._closed = True
        self._items.clear()
        self.end()

    @property
    def failure(self) -> MeshError | None:
        return self._failure

    @property
    def empty(self) -> bool:
        """Nothing queued right now."""
        return not self._items

    @property
    def depth(self) -> int:
        """Items queued right now."""
        return len(self._items)

    @property
    def getters(self) -> int:
        """Consumers waiting for an item right now."""
        return len(self._getters)

    @property
    def open(self) -> bool:
        """Neither ended, failed nor closed: someone may still be waiting on it."""
        return not (self._ended or self._closed)

    def __aiter__(self) -> Mailbox[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.get()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def check_integrity(self) -> None:
        """Asserts the queue's invariants (tests call it after each operation)."""
        assert len(self._items) <= self._capacity, "mailbox over capacity"
        assert not (self._closed and self._items), "closed mailbox still holds items"
        assert not (self._ended and self._putters), "producers wait on an ended mailbox"
        assert self._high_water <= self._capacity

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            depth=len(self._items),
            capacity=self._capacity,
            high_water=self._high_water,
            put=self._put,
            taken=self._put - len(self._items),
        )

    def _take(self) -> T:
        item = self._items.popleft()
        _wake_one(self._putters)
        return item

    async def _wait(self, waiters: deque[WakeUp]) -> None:
        event = new_event()
        waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event in waiters:
                waiters.remove(event)
            else:
                # A waker took us off the queue, so the turn is ours and we will not use it:
                # give it to the next waiter. (Not `event.is_set()`: on asyncio a cancelled
                # waiter's future is cancelled at once, and the waker's set() then does
                # nothing, yet the turn was handed to us.)
                _wake_one(waiters)
            raise


def _wake_one(waiters: deque[WakeUp]) -> None:
    if waiters:
        waiters.popleft().set()


def _wake_all(waiters: deque[WakeUp]) -> None:
    while waiters:
        waiters.popleft().set()
