"""The dashboard's controls acting on a simulated world (the shape of ui's `ControlClient`).

Each control does to the world what the live services' APIs do to a mesh, with the same code:
link changes go through netem's own `/link` update rules to the link's shaper, the policy,
threshold and worker roles through the router's control plane (`RouterControl`), and the
answers have the shapes of GET /link and GET /admin/state, so the page cannot tell them
apart. Two controls exist only here: the page's load is the simulation's `LiveLoad`, and the
speed of virtual time is the `PacedClock`'s rate. Errors are the contract's `ControlError`.
`CompareControls` are the compare page's: the shared load and the clock, nothing else.

The requests are ui's control structs; they are read through small protocols, since the
simulation sits beside the dashboard, not above it (services never import ui).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from mesh.errors import ConfigError
from netem.params import LinkError
from netem.toxics import apply_link_update, params_view
from services.contract.errors import ControlError
from services.router.control import RouterControl
from services.router.errors import RouterError
from services.sim.clock import MAX_RATE, PacedClock
from services.sim.compare import CompareSim
from services.sim.live import LiveSim
from services.sim.world import SimWorld

JsonObject = dict[str, Any]


class PolicyChange(Protocol):
    @property
    def policy(self) -> str: ...


class ThresholdChange(Protocol):
    @property
    def t(self) -> float | None: ...


class LoadChange(Protocol):
    @property
    def action(self) -> str: ...
    @property
    def rate(self) -> float: ...
    @property
    def kind(self) -> str: ...


class RoleChange(Protocol):
    @property
    def role(self) -> Any: ...


class SpeedChange(Protocol):
    @property
    def speed(self) -> float: ...


def set_clock_speed(clock: PacedClock | None, speed: float) -> None:
    """The page's speed control: virtual seconds per wall second of a paced clock."""
    if clock is None:
        raise ControlError(409, "this simulation runs as fast as it can, not paced")
    if not 0 < speed <= MAX_RATE:
        raise ControlError(400, f"speed must be within (0, {MAX_RATE:g}], got {speed!r}")
    clock.rate = speed


def _refused(exc: RouterError) -> ControlError:
    return ControlError(exc.status, f"router: {exc.message}")


class SimControls:
    """Controls over `sim`'s world while it runs; 503 before it has opened."""

    def __init__(self, sim: LiveSim) -> None:
        self.sim = sim

    def _world(self) -> SimWorld:
        if self.sim.world is None:
            raise ControlError(503, "the simulation is not running (yet)")
        return self.sim.world

    def _link_view(self, world: SimWorld) -> JsonObject | None:
        for name, link in world.links.items():
            stats = msgspec.to_builtins(link.shaper.statistics())
            return {"name": name, **params_view(link.shaper.params), "statistics": stats}
        return None

    def _router_view(self, world: SimWorld) -> JsonObject:
        load = self.sim.load
        workload = msgspec.to_builtins(load.statistics()) if load is not None else None
        return {**world.control.state(), "workload": workload}

    def _sim_view(self) -> JsonObject:
        clock = self.sim.clock
        return {"deployment": self.sim.deployment.name, "virtual_s": self.sim.virtual_s(),
                "speed": clock.rate if clock is not None else None,
                "achieved": clock.statistics().achieved if clock is not None else None}

    async def state(self) -> JsonObject:
        result: JsonObject = {"link": None, "router": None, "errors": {}, "sim": None}
        try:
            world = self._world()
        except ControlError as exc:
            result["errors"] = {"link": str(exc), "router": str(exc)}
            return result
        result["link"], result["router"] = self._link_view(world), self._router_view(world)
        result["sim"] = self._sim_view()
        if result["link"] is None:
            result["errors"]["link"] = "link: this deployment has no PrfaaS cluster, no link"
        return result

    async def update_link(self, update: object) -> JsonObject:
        world = self._world()
        view = self._link_view(world)
        if view is None:
            raise ControlError(503, "link: this deployment has no PrfaaS cluster, no link")
        shaper = world.links[view["name"]].shaper
        try:
            shaper.set_params(apply_link_update(shaper.params, msgspec.to_builtins(update)))
        except LinkError as exc:
            raise ControlError(400, f"link: {exc}") from exc
        return self._link_view(world) or {}

    async def set_policy(self, request: PolicyChange) -> JsonObject:
        return self._change_router(lambda control: control.set_policy(request.policy))

    async def set_threshold(self, request: ThresholdChange) -> JsonObject:
        return self._change_router(lambda control: control.set_threshold(request.t))

    async def workload(self, request: LoadChange) -> JsonObject:
        world = self._world()
        load = self.sim.load
        if load is None:
            raise ControlError(503, "the simulation's load is not running")
        try:
            load.start(request.rate, request.kind) if request.action == "start" else load.stop()
        except ConfigError as exc:
            raise ControlError(400, f"load: {exc}") from exc
        return self._router_view(world)

    async def set_role(self, worker: str, request: RoleChange) -> JsonObject:
        reason = f"converted to {request.role} from the dashboard"
        return self._change_router(lambda control: control.convert(worker, request.role, reason))

    async def drain(self, worker: str) -> JsonObject:
        reason = "drained from the dashboard"
        return self._change_router(lambda control: control.drain(worker, reason))

    def _change_router(self, change: Callable[[RouterControl], object]) -> JsonObject:
        """`change` made to the router's control loop; the router's view after it (a refusal is
        the caller's error)."""
        world = self._world()
        try:
            change(world.control)
        except RouterError as exc:
            raise _refused(exc) from exc
        return self._router_view(world)

    async def set_speed(self, request: SpeedChange) -> JsonObject:
        set_clock_speed(self.sim.clock, request.speed)
        return self._sim_view()

    async def processes(self) -> JsonObject:
        # The simulation's services are tasks of one process: no supervisor, nothing to kill.
        return {"processes": [], "stopping": False, "supervised": False}

    async def kill(self, process: str) -> JsonObject:
        raise ControlError(409, f"kill {process!r}: the simulation's services are tasks of one "
                                "process, not processes (prfaas up runs the live mesh)")

    async def restart(self, process: str) -> JsonObject:
        raise ControlError(409, f"restart {process!r}: the simulation's services are tasks of "
                                "one process, not processes")

    async def aclose(self) -> None:
        return None


class CompareControls:
    """The compare page's controls over a `CompareSim`: the shared load's rate and the clock's
    speed. Everything else belongs to one deployment and is refused (409): the comparison is
    fair only while the deployments differ in nothing but what they are."""

    def __init__(self, sim: CompareSim) -> None:
        self.sim = sim

    def _sim_view(self) -> JsonObject:
        clock = self.sim.clock
        return {"deployment": ",".join(c.name for c in self.sim.columns),
                "virtual_s": self.sim.virtual_s(),
                "speed": clock.rate if clock is not None else None,
                "achieved": clock.statistics().achieved if clock is not None else None}

    def _load_view(self) -> JsonObject:
        load = self.sim.load
        if load is None:
            raise ControlError(503, "the comparison is not running (yet)")
        return {"sim": self._sim_view(), "workload": msgspec.to_builtins(load.statistics())}

    async def state(self) -> JsonObject:
        try:
            return {"link": None, "router": None, "errors": {}, **self._load_view()}
        except ControlError as exc:
            return {"link": None, "router": None, "errors": {"sim": str(exc)}, "sim": None}

    async def workload(self, request: LoadChange) -> JsonObject:
        view = self._load_view()
        load = self.sim.load
        assert load is not None  # _load_view checked
        try:
            load.start(request.rate, request.kind) if request.action == "start" else load.stop()
        except ConfigError as exc:
            raise ControlError(400, f"load: {exc}") from exc
        return {**view, "workload": msgspec.to_builtins(load.statistics())}

    async def set_speed(self, request: SpeedChange) -> JsonObject:
        set_clock_speed(self.sim.clock, request.speed)
        return self._sim_view()

    def _refuse(self, what: str) -> ControlError:
        return ControlError(409, f"{what}: the comparison's deployments differ only in what "
                                 "they are; run prfaas sim-dashboard without --compare to "
                                 "steer one")

    async def update_link(self, update: object) -> JsonObject:
        raise self._refuse("link")

    async def set_policy(self, request: PolicyChange) -> JsonObject:
        raise self._refuse("policy")

    async def set_threshold(self, request: ThresholdChange) -> JsonObject:
        raise self._refuse("threshold")

    async def set_role(self, worker: str, request: RoleChange) -> JsonObject:
        raise self._refuse(f"role of {worker!r}")

    async def drain(self, worker: str) -> JsonObject:
        raise self._refuse(f"drain {worker!r}")

    async def processes(self) -> JsonObject:
        return {"processes": [], "stopping": False, "supervised": False}

    async def kill(self, process: str) -> JsonObject:
        raise self._refuse(f"kill {process!r}")

    async def restart(self, process: str) -> JsonObject:
        raise self._refuse(f"restart {process!r}")

    async def aclose(self) -> None:
        return None
