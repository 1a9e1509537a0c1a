"""The router's control plane: the control loops and the admin actions over one scheduler.

- `tick` (every `tick_s`): poll each worker's `WorkerState` (the worker table of
  services/router/scheduler.py), estimate every link's bandwidth from its senders' counters in
  those states (services/router/link_meter.py), sample what the transport tells of every link
  (up, stalls, queued bytes: its control API's GET /link, netem/control.py: `http_link_probe`),
  feed all of it to the policy, apply what the policy's `tick` returns (a
  threshold move is announced as `ThresholdChanged`; a role conversion drains the worker,
  then switches it: `RoleChanged` old -> "draining" -> new);
- the admin API (services/router/openai.py maps it to HTTP): switch policy, pin or clear t, drain
  a worker, convert a PD worker, and the state the dashboard shows.

`run` ticks once before it reports itself started, so a router refuses to start when a
worker's model has another block size than its own (`ModelMismatch`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import httpx
import msgspec

from mesh import native
from mesh.errors import ConfigError, MeshError
from mesh.topology import Topology
from services.contract.events import RoleChanged, ThresholdChanged
from services.contract.messages import SetRole
from services.contract.types import Role
from services.router.errors import Conflict, InvalidRequest, RouterError
from services.router.policies import POLICIES, create_policy
from services.router.policy import (
    LinkSample,
    PolicyError,
    SetThreshold,
    action_event,
    json_threshold,
)
from services.router.scheduler import Scheduler
from services.router.workers import StatusReader, WorkerEntry
from services.service import link_service_of

log = logging.getLogger(__name__)

LinkProbe = Callable[[], Awaitable[LinkSample | None]]


def link_sample(view: Mapping[str, Any], now: float, link: str = "") -> LinkSample:
    """What the transport tells of the link, from its GET /link answer (netem/control.py):
    up, stalls, queued bytes. Its rate, utilisation and the queue's wire time are left out on
    purpose: the router measures the rate from its own transfers
    (services/router/link_meter.py)."""
    egress = view["statistics"]["link"]["egress"]
    return LinkSample(now=now, link=link, stalls=int(egress["stalls"]), up=bool(view["up"]),
                      queued_bytes=int(egress.get("queued_bytes", 0)))


def http_link_probe(client: httpx.AsyncClient, url: str, link: str = "") -> LinkProbe:
    """Samples the link's control API; a link that does not answer gives no sample (logged
    when it stops answering and when it is back, not at every tick)."""
    answering = [True]

    async def probe() -> LinkSample | None:
        try:
            response = await client.get(url)
            response.raise_for_status()
            sample = link_sample(response.json(), anyio.current_time(), link)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if answering[0]:
                log.warning("no link samples from %s: %s", url, exc)
            answering[0] = False
            return None
        if not answering[0]:
            log.info("link samples from %s are back", url)
        answering[0] = True
        return sample

    return probe


def link_url(topology: Topology) -> str | None:
    """GET /link of the first link service, if any."""
    for service in topology.find(kind="link"):
        port = service.options.get("control_port", 8474)
        return f"http://{service.host}:{port}/link"
    return None


def link_urls(topology: Topology) -> dict[str, str]:
    """GET /link of every link of the topology, by link name."""
    out = {}
    for link in topology.links:
        service = link_service_of(topology, link)
        port = service.options.get("control_port", 8474)
        out[link.name] = f"http://{service.host}:{port}/link"
    return out


class ControlConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tick_s: float = 1.0
    status_timeout_s: float = 2.0
    role_timeout_s: float = 300.0  # drain + switch of one worker

    def __post_init__(self) -> None:
        for name in ("tick_s", "status_timeout_s", "role_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")


class ControlStatistics(msgspec.Struct, frozen=True):
    ticks: int
    link_samples: int
    link_misses: int  # ticks whose link probe gave no sample
    conversions: int  # role conversions started (by the policy or by hand)


class RouterControl:
    """The control loops and admin actions over one scheduler (module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        config: ControlConfig | None = None,
        *,
        link_probe: LinkProbe | None = None,
        link_probes: Sequence[LinkProbe] = (),
        policy_options: Mapping[str, Mapping[str, object]] | None = None,
        status_reader: StatusReader | None = None,
    ) -> None:
        """`status_reader`: the workers' states read in this process instead of polled over
        the mesh (`StatusReader`), as the simulation does, whose link probe
        reads its link likewise."""
        self.scheduler = scheduler
        self._status_reader = status_reader
        self.config = config or ControlConfig()
        self._counts = dict.fromkeys(("ticks", "link_samples", "link_misses", "conversions"), 0)
        self._link_probes = [*([link_probe] if link_probe else []), *link_probes]
        self._policy_options = dict(policy_options or {})

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = (
            anyio.TASK_STATUS_IGNORED)) -> None:
        """Ticks every `tick_s` until cancelled; started once the first tick is done."""
        await self.tick()
        task_status.started()
        while True:
            await native.sleep(self.config.tick_s)
            await self.tick()

    async def tick(self) -> None:
        scheduler = self.scheduler
        self._counts["ticks"] += 1
        await scheduler.workers.poll(scheduler.node, self.config.status_timeout_s,
                                     scheduler.config.block_size,
                                     scheduler.tokenizer.vocab_size,
                                     read=self._status_reader)
        scheduler.measure_links()
        await self._sample_link()
        policy = scheduler.policy
        for action in policy.tick(scheduler.clock(), scheduler.workers.state()):
            if isinstance(action, SetThreshold):
                scheduler.events.publish(action_event(action, policy=policy.name,
                                                      ts=scheduler.clock()))
            else:
                self._policy_conversion(action.worker, action.to_role, action.reason)

    async def _sample_link(self) -> None:
        for probe in self._link_probes:
            sample = await probe()
            self._counts["link_samples" if sample else "link_misses"] += 1
            if sample is not None:
                self.scheduler.observe_link(sample)

    def _policy_conversion(self, name: str, role: Role, reason: str) -> None:
        """A conversion the policy asked for; one the table refuses is logged, not fatal."""
        try:
            self.convert(name, role, reason)
        except RouterError as exc:
            log.warning("policy %s asked to convert %s to %s: refused: %s",
                        self.scheduler.policy.name, name, role, exc.message)

    def set_policy(self, name: str) -> None:
        """Switches to a fresh policy `name` (its options from the router's config)."""
        try:
            policy = create_policy(name, self._policy_options.get(name))
        except PolicyError as exc:
            raise InvalidRequest(str(exc), param="policy") from exc
        old = self.scheduler.policy
        self.scheduler.policy = policy
        self._announce_threshold(json_threshold(old.threshold), f"policy {old.name} -> {name}")

    def set_threshold(self, t: float | None) -> None:
        """Pins t (tokens), or clears the pin with None."""
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise InvalidRequest(f"t must be a number of tokens >= 0 or null, got {t!r}",
                                 param="t")
        policy = self.scheduler.policy
        old = json_threshold(policy.threshold)
        try:
            policy.set_threshold_override(t)
        except PolicyError as exc:
            raise Conflict(str(exc), param="t") from exc
        why = "threshold override cleared" if t is None else "threshold pinned from the admin API"
        self._announce_threshold(old, why)

    def _announce_threshold(self, old: float | None, reason: str) -> None:
        policy = self.scheduler.policy
        self.scheduler.events.publish(ThresholdChanged(
            ts=self.scheduler.clock(), source="router", policy=policy.name, old=old,
            new=json_threshold(policy.threshold), reason=reason))

    def _pd_worker(self, name: str) -> WorkerEntry:
        worker = self.scheduler.workers.get(name)
        if worker.spec.kind != "pd":
            raise Conflict(f"{name} is a PrfaaS worker; only PD workers change role",
                           param="name")
        if worker.converting:
            raise Conflict(f"{name} is already being converted", param="name")
        return worker

    def drain(self, name: str, reason: str = "drained from the admin API") -> None:
        """The router sends `name` no new work (a later role change brings it back)."""
        worker = self._pd_worker(name)
        if not worker.draining:
            worker.draining = True
            self._announce_role(name, worker.role, "draining", reason)

    def convert(self, name: str, role: Role, reason: str) -> None:
        """Drains `name`, then has it switch to `role` (in the background)."""
        worker = self._pd_worker(name)
        old: Any = worker.shown_role
        worker.converting = True
        self._counts["conversions"] += 1
        self._announce_role(name, old, "draining", reason)
        self.scheduler.spawn(lambda: self._switch(worker, role, reason))

    async def _switch(self, worker: WorkerEntry, role: Role, reason: str) -> None:
        name = worker.spec.name
        try:
            await self.scheduler.node.call(name, SetRole(role=role, reason=reason),
                                           timeout=self.config.role_timeout_s)
        except MeshError as exc:
            log.warning("converting %s to %s failed: %s", name, role, exc)
            role, reason = worker.role, f"conversion to {role} failed: {exc}"
        worker.role, worker.converting, worker.draining = role, False, False
        self._announce_role(name, "draining", role, reason)

    def _announce_role(self, name: str, old: Any, new: Any, reason: str) -> None:
        self.scheduler.events.publish(RoleChanged(
            ts=self.scheduler.clock(), source="router", worker=name, old=old, new=new,
            reason=reason))

    def statistics(self) -> ControlStatistics:
        return ControlStatistics(**self._counts)

    def state(self) -> dict[str, Any]:
        """GET /admin/state: what the dashboard's controls show."""
        policy = self.scheduler.policy
        stats = policy.statistics()
        return {
            "policy": policy.name,
            "threshold": json_threshold(policy.threshold),
            "threshold_override": stats.override is not None,
            "offload_fraction": stats.offload_fraction,
            "policies": list(POLICIES),
            "workers": msgspec.to_builtins(self.scheduler.workers.statistics().workers),
            "inflight": len(self.scheduler.active()),
            # Each link as the router measures it from its own transfers (link_meter.py).
            "links": {name: {**msgspec.to_builtins(e), "utilisation": e.utilisation}
                      for name, e in self.scheduler.links.estimates().items()},
            "waits": _waits(stats),
            # The loop's counts: a client can tell how many link samples the policy has seen.
            "control": msgspec.to_builtins(self.statistics()),
        }


def _waits(stats: object) -> dict[str, float] | None:
    """The predicted waits a policy reports (prfaas-dynamic's), where finite; else None."""
    prfaas, pd = (getattr(stats, name, None) for name in ("wait_prfaas_s", "wait_pd_s"))
    if not (isinstance(prfaas, float) and isinstance(pd, float)):
        return None
    if not (math.isfinite(prfaas) and math.isfinite(pd)):
        return None
    return {"prfaas_s": prfaas, "pd_s": pd}
