"""Event bus: a service publishes typed events; subscribers (the dashboard) read them.

Publishing never blocks and never fails: each subscription holds a bounded buffer, and when a
slow subscriber's buffer is full the oldest event is dropped and counted, so a stalled
dashboard costs the service nothing but those drops. Events are whatever the application
publishes (typically tagged msgspec Structs, ready to encode as JSON).

    bus: EventBus[Event] = EventBus()
    with bus.subscribe(maxlen=256) as events:
        async for event in events: ...
"""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import ClassVar, Generic, TypeVar

import anyio
import msgspec

from mesh.errors import ConfigError

E = TypeVar("E")


class SubscriptionStatistics(msgspec.Struct, frozen=True):
    """One subscriber: events waiting, its bound, delivered and dropped so far."""

    queued: int
    maxlen: int
    delivered: int
    dropped: int


class EventBusStatistics(msgspec.Struct, frozen=True):
    """The bus: events published, live subscribers, deliveries and drops over all of them."""

    counters: ClassVar[frozenset[str]] = frozenset({"published", "delivered", "dropped"})

    published: int
    subscribers: int
    delivered: int
    dropped: int


class Subscription(Generic[E]):
    """A subscriber's bounded view of the bus; drops its oldest events when full."""

    def __init__(self, bus: EventBus[E], maxlen: int) -> None:
        self._bus = bus
        self._events: deque[E] = deque()
        self._maxlen = maxlen
        self._waiters: list[anyio.Event] = []
        self._closed = False
        self.delivered = 0
        self.dropped = 0

    def offer(self, event: E) -> None:
        """Called by the bus: queue `event`, dropping the oldest one if full."""
        if len(self._events) >= self._maxlen:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
        self._wake()

    async def receive(self) -> E:
        """The oldest queued event; waits for one; anyio.EndOfStream once closed and empty."""
        while not self._events:
            if self._closed:
                raise anyio.EndOfStream
            waiter = anyio.Event()
            self._waiters.append(waiter)
            try:
                await waiter.wait()
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.delivered += 1
        return self._events.popleft()

    def drain(self) -> list[E]:
        """Every queued event, oldest first, without waiting (a reader that polls)."""
        events = list(self._events)
        self._events.clear()
        self.delivered += len(events)
        return events

    def close(self) -> None:
        """Leaves the bus; queued events can still be read, then the iteration ends."""
        if not self._closed:
            self._closed = True
            self._bus.unsubscribe(self)
            self._wake()

    def statistics(self) -> SubscriptionStatistics:
        return SubscriptionStatistics(len(self._events), self._maxlen, self.delivered, self.dropped)

    def _wake(self) -> None:
        for waiter in self._waiters:
            waiter.set()
        self._waiters.clear()

    def __aiter__(self) -> Subscription[E]:
        return self

    async def __anext__(self) -> E:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def __enter__(self) -> Subscription[E]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class EventBus(Generic[E]):
    """Fan-out of events to any number of bounded subscriptions."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription[E]] = []
        self._published = 0
        self._gone_delivered = 0
        self._gone_dropped = 0
        self._joined: anyio.Event | None = None  # made by the first waiter, set on a subscribe

    @property
    def subscribed(self) -> bool:
        """Someone reads now: a publisher on a hot path builds its events only then."""
        return bool(self._subscriptions)

    def publish(self, event: E) -> None:
        """Hands `event` to every subscriber; never blocks."""
        self._published += 1
        for subscription in self._subscriptions:
            subscription.offer(event)

    def subscribe(self, maxlen: int = 1024) -> Subscription[E]:
        """A new subscription seeing events published from now on (close it, or use `with`)."""
        if maxlen < 1:
            raise ConfigError(f"maxlen must be >= 1, got {maxlen}")
        subscription = Subscription(self, maxlen)
        self._subscriptions.append(subscription)
        if self._joined is not None:
            self._joined.set()
            self._joined = None
        return subscription

    async def wait_subscribed(self) -> None:
        """Returns once the bus has a subscriber (at once if it has one): a publisher whose
        events cost something to make waits here while nobody would read them."""
        while not self._subscriptions:
            if self._joined is None:
                self._joined = anyio.Event()
            await self._joined.wait()

    def unsubscribe(self, subscription: Subscription[E]) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)
            self._gone_delivered += subscription.delivered
            self._gone_dropped += subscription.dropped

    def statistics(self) -> EventBusStatistics:
        subs = self._subscriptions
        return EventBusStatistics(
            published=self._published,
            subscribers=len(subs),
            delivered=self._gone_delivered + sum(s.delivered for s in subs),
            dropped=self._gone_dropped + sum(s.dropped for s in subs),
        )
