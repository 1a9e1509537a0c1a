"""The simulation's telemetry as a mesh's dashboard feed sees it: every bus of the world, merged.

`SimFeed` subscribes to the event bus of each service the world runs (the router's scheduler,
every worker, the cache directory) and, as the live link service does, publishes a `LinkStats`
sample of each link's shaper every `stats_interval_s` of virtual time. Events carry virtual
times; `offset` is added to each (as the mesh's feed turns monotonic stamps into wall time),
so a page can show them as times of day starting now. A recording keeps offset 0.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import ClassVar

import anyio
import msgspec

from mesh.errors import ConfigError
from mesh.events import EventBus, Subscription
from services.contract.events import AnyEvent, Event
from services.link.service import link_stats
from services.sim.world import SimWorld

Publish = Callable[[AnyEvent], None]


class FeedStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset({"events", "link_samples", "dropped"})

    buses: int
    events: int  # handed on, link samples included
    link_samples: int
    dropped: int  # events a bus dropped because this feed fell behind


def world_buses(world: SimWorld) -> list[EventBus[Event]]:
    """Every event bus of the world: router, cache directory, workers (in that order)."""
    buses = [world.scheduler.events]
    if world.cachedir is not None:
        buses.append(world.cachedir.bus)
    return buses + [worker.bus for worker in world.workers.values()]


class SimFeed:
    """Publishes every event of a running world, restamped by `offset`, until cancelled."""

    def __init__(self, world: SimWorld, *, offset: float = 0.0, stats_interval_s: float = 1.0,
                 maxlen: int = 1 << 16) -> None:
        if not stats_interval_s > 0:
            raise ConfigError(f"stats_interval_s must be > 0, got {stats_interval_s!r}")
        self.world, self.offset = world, offset
        self.stats_interval_s, self.maxlen = stats_interval_s, maxlen
        self._subscriptions: list[Subscription[Event]] = []
        self._events = self._link_samples = 0

    async def run(self, publish: Publish) -> None:
        with ExitStack() as stack:
            # Subscribed before any task starts, so nothing published from now on is missed.
            self._subscriptions = [stack.enter_context(bus.subscribe(self.maxlen))
                                   for bus in world_buses(self.world)]
            async with anyio.create_task_group() as tasks:
                for subscription in self._subscriptions:
                    tasks.start_soon(self._follow, subscription, publish)
                tasks.start_soon(self._sample_links, publish)

    async def _follow(self, subscription: Subscription[Event], publish: Publish) -> None:
        async for event in subscription:
            self._hand_on(event, publish)

    async def _sample_links(self, publish: Publish) -> None:
        specs = {spec.name: spec for spec in self.world.topology.links}
        while True:
            for name, link in self.world.links.items():
                spec = specs[name]
                sample = link_stats(name, name, link.shaper.statistics())
                self._link_samples += 1
                self._hand_on(msgspec.structs.replace(sample, a=spec.a, b=spec.b), publish)
            await anyio.sleep(self.stats_interval_s)

    def _hand_on(self, event: Event, publish: Publish) -> None:
        if self.offset:
            event = msgspec.structs.replace(event, ts=event.ts + self.offset)
        self._events += 1
        publish(event)  # type: ignore[arg-type]  # the services publish AnyEvent's members

    def statistics(self) -> FeedStatistics:
        dropped = sum(s.statistics().dropped for s in self._subscriptions)
        return FeedStatistics(len(self._subscriptions), self._events, self._link_samples,
                              dropped)
