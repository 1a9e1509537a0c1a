"""Event bus: fan-out, drop-oldest under pressure with counted drops, clean unsubscribe."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import trio
import trio.testing

from mesh.errors import ConfigError
from mesh.events import EventBus


class Tick(msgspec.Struct, frozen=True, tag=True):
    n: int


@pytest.mark.trio
async def test_every_subscriber_sees_every_event_in_order() -> None:
    bus: EventBus[Tick] = EventBus()
    with bus.subscribe() as first, bus.subscribe() as second:
        for n in range(3):
            bus.publish(Tick(n))
        assert [await first.receive() for _ in range(3)] == [Tick(0), Tick(1), Tick(2)]
        assert [await second.receive() for _ in range(3)] == [Tick(0), Tick(1), Tick(2)]
    assert bus.statistics() == bus.statistics().__class__(
        published=3, subscribers=0, delivered=6, dropped=0)


@pytest.mark.trio
async def test_slow_subscriber_loses_the_oldest_and_counts_drops() -> None:
    bus: EventBus[Tick] = EventBus()
    slow = bus.subscribe(maxlen=4)
    fast = bus.subscribe(maxlen=100)
    for n in range(10):
        bus.publish(Tick(n))
    assert slow.statistics().dropped == 6
    assert fast.statistics().dropped == 0
    assert [await slow.receive() for _ in range(4)] == [Tick(n) for n in range(6, 10)]
    stats = bus.statistics()
    assert (stats.published, stats.dropped, stats.delivered) == (10, 6, 4)
    slow.close()
    fast.close()
    # Drops of departed subscribers stay counted.
    assert bus.statistics().dropped == 6


@pytest.mark.trio
async def test_subscriber_waits_for_events_and_ends_on_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bus: EventBus[Tick] = EventBus()
    subscription = bus.subscribe()
    got: list[Tick] = []

    async def publisher() -> None:
        for n in range(3):
            await trio.sleep(1)
            bus.publish(Tick(n))
        subscription.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(publisher)
        async for tick in subscription:
            got.append(tick)
    assert got == [Tick(0), Tick(1), Tick(2)]
    assert trio.current_time() == pytest.approx(3)
    with pytest.raises(anyio.EndOfStream):
        await subscription.receive()


def test_publish_without_subscribers_is_counted_and_harmless() -> None:
    bus: EventBus[int] = EventBus()
    bus.publish(1)
    assert bus.statistics().published == 1
    with pytest.raises(ConfigError, match="maxlen must be >= 1, got 0"):
        bus.subscribe(maxlen=0)


def test_drain_takes_every_queued_event_in_order_and_counts_them() -> None:
    bus: EventBus[Tick] = EventBus()
    with bus.subscribe() as events:
        assert events.drain() == []
        for n in range(3):
            bus.publish(Tick(n))
        assert events.drain() == [Tick(0), Tick(1), Tick(2)]
        assert events.drain() == []
        assert events.statistics().delivered == 3


@pytest.mark.trio
async def test_wait_subscribed_returns_once_someone_subscribes(
        autojump_clock: trio.testing.MockClock) -> None:
    bus: EventBus[Tick] = EventBus()
    returned: list[float] = []

    async def waiter() -> None:
        await bus.wait_subscribed()
        returned.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(5.0)
        assert returned == []
        with bus.subscribe():
            await trio.sleep(1.0)
    assert returned == [5.0]
    with bus.subscribe():
        await bus.wait_subscribed()  # returns at once


def test_subscribed_says_whether_anyone_reads_now() -> None:
    bus: EventBus[int] = EventBus()
    assert not bus.subscribed
    with bus.subscribe() as first:
        assert bus.subscribed
        with bus.subscribe():
            pass
        assert bus.subscribed  # the first still reads
    assert not bus.subscribed and first.statistics().queued == 0
