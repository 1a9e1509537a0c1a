"""The hub: in-process fan-out of telemetry events to the browsers, and the state they fold into.

Every event is folded into `DashboardState` (the snapshot and the chart points) and encoded to
JSON once; each connected browser then gets the same bytes through its own `ClientFeed`, a
bounded queue that drops its oldest events when the browser falls behind, counting them. The
sequence numbers let a page tell a gap (drops) from a clean stream and line up its snapshot.

Live events come in through `publish`; a replay owns the hub through `reset("replay")` and
`publish_replayed`, and live events are ignored (counted) until `reset("live")`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, Protocol

import anyio
import msgspec

from services.contract.events import AnyEvent, encode_json
from ui.config import DashboardConfig
from ui.state import DashboardState, Mode, Snapshot

_encoder = msgspec.json.Encoder()


class EventSource(Protocol):
    """Where live events come from (the mesh's event buses, the synthetic demo, ...).

    `run` publishes every event it gets until cancelled; the dashboard owns the task.
    """

    async def run(self, publish: Callable[[AnyEvent], None]) -> None: ...


class NoSource:
    """No live events: a dashboard that only plays recorded logs."""

    async def run(self, publish: Callable[[AnyEvent], None]) -> None:
        await anyio.sleep_forever()


class FeedBatch(msgspec.Struct, frozen=True):
    """Events taken from a feed at once: contiguous sequence numbers from `first_seq`."""

    first_seq: int
    events: list[bytes]  # each one JSON object
    dropped: int  # events dropped (the oldest) since the previous batch
    reset: bool  # the hub was reset before these events: the page must refetch its snapshot


class FeedStatistics(msgspec.Struct, frozen=True):
    queued: int
    maxlen: int
    delivered: int
    dropped: int


class ClientFeed:
    """One browser's bounded queue of encoded events; full, it drops the oldest and counts."""

    def __init__(self, maxlen: int) -> None:
        self._items: deque[tuple[int, bytes]] = deque()
        self._maxlen = maxlen
        self._wakeup: anyio.Event | None = None
        self._reset = False
        self._unreported_drops = 0
        self.closed = False
        self.delivered = 0
        self.dropped = 0

    def offer(self, seq: int, data: bytes) -> None:
        if len(self._items) >= self._maxlen:
            self._items.popleft()
            self.dropped += 1
            self._unreported_drops += 1
        self._items.append((seq, data))
        self._wake()

    def reset(self) -> None:
        """Forgets the queued events and tells the browser to start over from a snapshot."""
        self._items.clear()
        self._reset = True
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    @property
    def ready(self) -> bool:
        return bool(self._items) or self._reset or self.closed

    async def wait(self) -> None:
        """Returns once there is something to take, or the feed is closed."""
        while not self.ready:
            self._wakeup = anyio.Event()
            await self._wakeup.wait()

    def take(self, max_items: int) -> FeedBatch | None:
        """Up to `max_items` of the oldest events; None when there is nothing to send."""
        if not self._items and not self._reset:
            return None
        count = min(max_items, len(self._items))
        items = [self._items.popleft() for _ in range(count)]
        first = items[0][0] if items else 0
        batch = FeedBatch(first, [data for _, data in items], self._unreported_drops, self._reset)
        self._unreported_drops, self._reset = 0, False
        self.delivered += count
        return batch

    def statistics(self) -> FeedStatistics:
        return FeedStatistics(len(self._items), self._maxlen, self.delivered, self.dropped)

    def check_integrity(self) -> None:
        assert len(self._items) <= self._maxlen, len(self._items)
        if self._items:
            first, last = self._items[0][0], self._items[-1][0]
            # Drops only ever take the oldest, so what remains is always contiguous.
            assert last - first + 1 == len(self._items), (first, last, len(self._items))

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


class HubStatistics(msgspec.Struct, frozen=True):
    """The hub: replaying or live, events in and out, browsers connected, drops."""

    counters: ClassVar[frozenset[str]] = frozenset(
        {"published", "ignored", "points", "delivered", "dropped", "resets"}
    )

    replaying: bool
    seq: int
    clients: int
    published: int  # telemetry events folded in (live or replayed)
    ignored: int  # live events that arrived during a replay (or replayed ones after it)
    points: int  # chart points emitted
    delivered: int  # events handed to browsers, over all of them
    dropped: int  # events browsers lost by falling behind
    resets: int


class EventHub:
    """Folds events into the dashboard state and fans them out to every connected browser."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.state = DashboardState(config)
        self.mode: Mode = "live"
        self._feeds: list[ClientFeed] = []
        self._seq = 0
        self._published = self._ignored = self._points = self._resets = 0
        self._gone_delivered = self._gone_dropped = 0
        self._closed = False

    def publish(self, event: AnyEvent) -> None:
        """A live event; ignored (and counted) while a replay owns the hub. Never blocks.

        Call it from the dashboard's event loop (an `EventSource` task does); from another
        thread, go through `anyio.from_thread.run_sync`.
        """
        if self.mode != "live":
            self._ignored += 1
            return
        self._fold(event)

    def publish_replayed(self, event: AnyEvent) -> None:
        """An event from a recorded log; ignored (and counted) unless a replay owns the hub."""
        if self.mode != "replay":
            self._ignored += 1
            return
        self._fold(event)

    def _fold(self, event: AnyEvent) -> None:
        self._published += 1
        points = self.state.apply(event)
        # The points it closed are older than the event itself: they go first, in time order.
        for point in points:
            self._points += 1
            self._send(_encoder.encode(point))
        self._send(encode_json(event))

    def _send(self, data: bytes) -> None:
        self._seq += 1
        for feed in self._feeds:
            feed.offer(self._seq, data)

    def reset(self, mode: Mode) -> None:
        """Starts over in `mode` with an empty state; every browser refetches its snapshot."""
        self.mode = mode
        self.state = DashboardState(self.config)
        self._resets += 1
        for feed in self._feeds:
            feed.reset()

    @contextmanager
    def subscribe(self) -> Iterator[ClientFeed]:
        """A feed of the events published from now on, for one browser."""
        feed = ClientFeed(self.config.client_buffer)
        if self._closed:
            feed.close()
        self._feeds.append(feed)
        try:
            yield feed
        finally:
            self._feeds.remove(feed)
            self._gone_delivered += feed.delivered
            self._gone_dropped += feed.dropped

    def close(self) -> None:
        """Ends every feed (their streams finish once drained); for shutdown."""
        self._closed = True
        for feed in self._feeds:
            feed.close()

    @property
    def seq(self) -> int:
        """The sequence number of the last event sent out."""
        return self._seq

    def snapshot(self) -> Snapshot:
        mode = self.config.live_mode if self.mode == "live" else self.mode
        return self.state.snapshot(self._seq, mode)

    def statistics(self) -> HubStatistics:
        feeds = self._feeds
        return HubStatistics(
            replaying=self.mode == "replay",
            seq=self._seq,
            clients=len(feeds),
            published=self._published,
            ignored=self._ignored,
            points=self._points,
            delivered=self._gone_delivered + sum(feed.delivered for feed in feeds),
            dropped=self._gone_dropped + sum(feed.dropped for feed in feeds),
            resets=self._resets,
        )

    def check_integrity(self) -> None:
        self.state.check_integrity()
        for feed in self._feeds:
            feed.check_integrity()
