"""The synthetic demo as the dashboard sees a mesh: a live event source and its controls.

`synthetic_demo()` gives a `SyntheticSource` (the simulation advanced by the wall clock) and
`DemoControls` (the page's controls acting on the simulation, answering what the link and
router APIs would). `python -m ui.demo --seconds 30 --out log.jsonl` records a replay log.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import msgspec

from services.contract.events import AnyEvent
from services.contract.types import WorkerRole as Role
from ui.controls import (
    ControlClient,
    JsonObject,
    LinkUpdate,
    PolicyRequest,
    RoleRequest,
    ThresholdRequest,
    WorkloadRequest,
    check_worker_name,
)
from ui.demo_mesh import SyntheticMesh
from ui.demo_model import POLICIES, SyntheticConfig, Worker
from ui.errors import ControlError
from ui.replay import write_log


class SyntheticSource:
    """Advances the simulation with a clock, publishing what happens; runs until cancelled."""

    def __init__(
        self, mesh: SyntheticMesh, *, clock: Callable[[], float] = time.time, tick_s: float = 0.05
    ) -> None:
        self.mesh = mesh
        self._clock = clock
        self._tick_s = tick_s

    async def run(self, publish: Callable[[AnyEvent], None]) -> None:
        offset = self.mesh.now - self._clock()
        while True:
            for event in self.mesh.advance_to(self._clock() + offset):
                publish(event)
            await anyio.sleep(self._tick_s)


class DemoControls:
    """The `ControlClient` of the synthetic mesh: controls change the simulation at once.

    With `link` (a client of a real link's control API), link changes go to that link first
    and the simulation takes the parameters the link answers with.
    """

    def __init__(self, mesh: SyntheticMesh, link: ControlClient | None = None) -> None:
        self.mesh = mesh
        self._link = link

    def _link_view(self) -> JsonObject:
        mesh = self.mesh
        stats = msgspec.to_builtins(mesh.link.statistics())
        return {"name": mesh.link.name, **mesh.link.params, "statistics": stats}

    def _router_view(self) -> JsonObject:
        mesh = self.mesh
        workers = [
            {"name": w.name, "cluster": w.cluster, "role": w.role} for w in mesh.workers.values()
        ]
        return {
            "policy": mesh.policy,
            "threshold": mesh.threshold,
            "threshold_override": mesh.threshold_override,
            "policies": list(POLICIES),
            "workers": workers,
            "workload": {"running": mesh.running, "rate": mesh.rate},
        }

    async def state(self) -> JsonObject:
        link = (await self._link.state())["link"] if self._link else self._link_view()
        return {"link": link, "router": self._router_view(), "errors": {}}

    async def update_link(self, update: LinkUpdate) -> JsonObject:
        given = msgspec.structs.asdict(update).items()
        changes = {key: value for key, value in given if value is not msgspec.UNSET}
        answer = None
        if self._link is not None:
            answer = await self._link.update_link(update)
            changes = {key: answer[key] for key in self.mesh.link.params if key in answer}
        self.mesh.set_link(changes)
        return answer if answer is not None else self._link_view()

    async def set_policy(self, request: PolicyRequest) -> JsonObject:
        if request.policy not in POLICIES:
            known = ", ".join(POLICIES)
            raise ControlError(400, f"policy must be one of {known}; got {request.policy!r}")
        self.mesh.set_policy(request.policy, "set from the dashboard")
        return self._router_view()

    async def set_threshold(self, request: ThresholdRequest) -> JsonObject:
        mesh = self.mesh
        mesh.threshold_override = request.t is not None
        if request.t is not None:
            mesh.set_threshold(request.t, "override from the dashboard")
        return self._router_view()

    async def workload(self, request: WorkloadRequest) -> JsonObject:
        if request.action == "start":
            self.mesh.start(request.rate)
        else:
            self.mesh.stop()
        return self._router_view()

    def _worker(self, name: str) -> Worker:
        worker = self.mesh.workers.get(check_worker_name(name))
        if worker is None:
            raise ControlError(404, f"no worker named {name!r}")
        if worker.cluster == "prfaas":
            raise ControlError(409, f"{name} is a PrfaaS worker; only PD workers change role")
        return worker

    async def set_role(self, worker: str, request: RoleRequest) -> JsonObject:
        role: Role = request.role
        self.mesh.set_role(self._worker(worker), role, f"converted to {role} from the dashboard")
        self.mesh.sample_now(measure=False)
        return self._router_view()

    async def drain(self, worker: str) -> JsonObject:
        self.mesh.set_role(self._worker(worker), None, "drained from the dashboard")
        self.mesh.sample_now(measure=False)
        return self._router_view()

    async def processes(self) -> JsonObject:
        # The synthetic mesh runs inside this process: no supervisor, no processes to show.
        return {"processes": [], "stopping": False}

    async def kill(self, process: str) -> JsonObject:
        raise ControlError(503, "the simulated mesh has no processes to kill")

    async def restart(self, process: str) -> JsonObject:
        raise ControlError(503, "the simulated mesh has no processes to restart")

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()


def synthetic_demo(config: SyntheticConfig | None = None) -> tuple[SyntheticSource, DemoControls]:
    """A live synthetic mesh starting now (event times are wall-clock seconds)."""
    config = config or SyntheticConfig()
    mesh = SyntheticMesh(msgspec.structs.replace(config, start_ts=time.time()))
    return SyntheticSource(mesh), DemoControls(mesh)


def record(config: SyntheticConfig, seconds: float) -> list[AnyEvent]:
    """The first `seconds` of a synthetic run (instant: it is simulated, not waited for)."""
    return SyntheticMesh(config).advance_to(config.start_ts + seconds)


def record_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ui.demo", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines log to write")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    config = SyntheticConfig(seed=args.seed, rate=args.rate, stats_interval_s=args.stats_interval)
    count = write_log(args.out, record(config, args.seconds))
    print(f"{count} events, {args.out.stat().st_size} bytes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(record_main())
