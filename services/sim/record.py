"""Recording a simulation's telemetry: the event log a dashboard replays (ui/replays/).

`record_events` runs a `LiveSim` for `seconds` of virtual time and keeps every event it
publishes, in time order, with virtual timestamps from the world's opening; `record_virtual`
does it under trio on an autojumping clock (seconds of wall time for minutes of traffic);
`services.contract.events.write_event_log` writes them as the log the dashboard reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec
import trio

from mesh.run import fewer_collections
from services.contract.events import AnyEvent
from services.sim.clock import JumpClock
from services.sim.live import LiveConfig, LiveSim
from services.sim.run import LinkChange
from services.sim.workload import Arrival
from services.sim.world import Deployment


async def record_events(deployment: Deployment, seconds: float, *,
                        config: LiveConfig | None = None, arrivals: Sequence[Arrival] = (),
                        changes: Sequence[LinkChange] = ()) -> list[AnyEvent]:
    """The events of the first `seconds` of virtual time, stamped from 0 at the opening."""
    config = msgspec.structs.replace(config or LiveConfig(), wall_clock=False)
    sim = LiveSim(deployment, arrivals=arrivals, changes=changes, config=config)
    events: list[AnyEvent] = []
    with anyio.move_on_after(seconds):
        await sim.run(events.append)
    start = sim.started_at
    stamped = [msgspec.structs.replace(e, ts=round(e.ts - start, 6)) for e in events]
    return sorted(stamped, key=lambda e: e.ts)


def record_virtual(deployment: Deployment, seconds: float, **options: object
                   ) -> list[AnyEvent]:
    """`record_events` under trio on a `JumpClock` (jumps whenever every task waits)."""
    async def main() -> list[AnyEvent]:
        return await record_events(deployment, seconds, **options)  # type: ignore[arg-type]

    with fewer_collections():
        return trio.run(main, clock=JumpClock())
