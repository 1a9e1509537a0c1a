"""The echo service: the smallest service on the mesh, proving the runtime end to end.

`prfaas serve echo` answers every `Echo` with the same text and one more hop, and publishes
nothing but serves the event stream like every service does.
"""

from __future__ import annotations

import anyio
import anyio.abc

from mesh.events import EventBus
from mesh.server import Context
from mesh.transport import Address
from services.contract.events import Event
from services.contract.messages import Echo
from services.service import ServiceContext, serve_events


async def run_echo(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = ctx.node()
    bus: EventBus[Event] = EventBus()
    serve_events(node, bus)

    @node.handles(Echo)
    async def on_echo(msg: Echo, request: Context) -> Echo:
        return Echo(text=msg.text, hops=msg.hops + 1)

    async with node:
        task_status.started(await node.listen())
        await anyio.sleep_forever()
