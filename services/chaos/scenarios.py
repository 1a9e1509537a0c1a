"""The scenarios: each breaks one thing under load and measures what the clients saw.

Every scenario reports requests sent, completed, explicit errors, hung and lost (load.py),
the service deaths it caused and those it did not, each service's RSS (at the scenario's start,
its peak during the scenario, and after it settled), the time until the broken part was
back and serving (a probe request answered, and a killed worker up in the router's table),
and the requests the router migrated meanwhile (its /metrics, before and after): how many, why,
and the mean time from a break to the continued request's first token.
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import msgspec

from services.chaos.faults import (
    Faults,
    envelope_frames,
    fire_frames,
    malformed_bodies,
    random_frames,
    send_raw,
)
from services.chaos.harness import ChaosMesh, rss_bytes
from services.chaos.load import Load, LoadConfig, Result, counts, send_one

RECOVER_LIMIT_S = 60.0


class ScenarioResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str
    sent: int
    outcomes: dict[str, int]  # completed, error, hung, lost
    statuses: dict[str, int]  # HTTP status (or "none") -> count
    killed: tuple[str, ...]  # services the scenario killed or restarted on purpose
    frozen: tuple[str, ...] = ()  # services it stopped (SIGSTOP) and woke on purpose
    deaths: dict[str, int]  # deaths per service during the scenario (killed ones included)
    rss_start: dict[str, int]
    rss_peak: dict[str, int]
    rss_after: dict[str, int]
    recover_s: float | None  # None: not back within RECOVER_LIMIT_S
    max_after_admission_s: float | None = None  # overload: slowest answer after admission
    notes: tuple[str, ...] = ()
    migrations: dict[str, int] = {}  # requests the router continued elsewhere, by reason
    resume_s: float | None = None  # their mean time from the break to the next token
    error_samples: tuple[str, ...] = ()  # what the first few distinct explicit errors said


class Migrations(msgspec.Struct, frozen=True):
    """The router's migration counters (prfaas_router_migrations* on its /metrics)."""

    by_reason: dict[str, int]
    resumed: float
    resume_s: float

    def since(self, before: Migrations) -> tuple[dict[str, int], float | None]:
        """The migrations between `before` and this, by reason, and their mean resume time."""
        moved = {r: n - before.by_reason.get(r, 0) for r, n in self.by_reason.items()}
        resumed = self.resumed - before.resumed
        mean = (self.resume_s - before.resume_s) / resumed if resumed else None
        return {r: n for r, n in moved.items() if n}, mean


_SAMPLE = re.compile(r'^prfaas_router_(migrations_total\{reason="(\w+)"\}|'
                     r'migrations_resumed_total|migration_resume_seconds_total) (\S+)$')


def migrations_of(metrics: str) -> Migrations:
    """The migration counters in the router's /metrics text."""
    by_reason: dict[str, int] = {}
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        found = _SAMPLE.match(line)
        if found is None:
            continue
        name, reason, value = found.groups()
        if reason:
            by_reason[reason] = int(float(value))
        else:
            values[name] = float(value)
    return Migrations(by_reason, values.get("migrations_resumed_total", 0.0),
                      values.get("migration_resume_seconds_total", 0.0))


class Run:
    """What every scenario shares: the mesh, its faults, an API client, the quick flag."""

    def __init__(self, mesh: ChaosMesh, client: httpx.AsyncClient, faults: Faults,
                 quick: bool, max_inflight: int) -> None:
        self.mesh, self.client, self.faults, self.quick = mesh, client, faults, quick
        self.max_inflight = max_inflight
        self.load_config = LoadConfig(deadline_s=30.0)
        self.rss_start: dict[str, int] = {}

    async def processes(self) -> dict[str, dict[str, Any]]:
        assert self.mesh.urls is not None
        response = await self.client.get(f"{self.mesh.urls.supervisor}/processes",
                                         headers=self.mesh.headers())
        return {p["name"]: p for p in response.json()["processes"]}

    async def rss(self) -> dict[str, int]:
        return {name: rss_bytes(p["pid"]) or 0 for name, p in (await self.processes()).items()}

    async def migrations(self) -> Migrations:
        assert self.mesh.urls is not None
        response = await self.client.get(f"{self.mesh.urls.api}/metrics")
        response.raise_for_status()
        return migrations_of(response.text)

    async def probe(self) -> bool:
        body = {"model": "prfaas", "prompt": "ROMEO: ", "max_tokens": 2, "stream": True}
        return (await send_one(self.client, body, 10.0)).outcome == "completed"

    async def worker_up(self, name: str) -> bool:
        assert self.mesh.urls is not None
        try:
            response = await self.client.get(f"{self.mesh.urls.api}/admin/state",
                                             headers=self.mesh.headers())
            workers = response.json().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return False
        return any(w.get("name") == name and w.get("up") for w in workers) or not any(
            w.get("name") == name for w in workers)

    async def recovered(self, since: float, names: tuple[str, ...] = (),
                        old_pids: dict[str, int] | None = None) -> float | None:
        """Seconds from `since` until every name is up again (a new pid when `old_pids` names
        the killed one; up in the supervisor and the router) and a probe request completes;
        None past RECOVER_LIMIT_S."""
        old = old_pids or {}
        with anyio.move_on_after(RECOVER_LIMIT_S):
            while True:
                states = await self.processes()
                up = all(states[n]["state"] == "up" and states[n]["pid"] != old.get(n)
                         for n in names)
                if up and all([await self.worker_up(n) for n in names]) and await self.probe():
                    return time.monotonic() - since
                await anyio.sleep(0.25)
        return None


async def measure(run: Run, name: str, description: str, killed: tuple[str, ...],
                  body: Callable[[Load], Awaitable[tuple[float | None, list[str]]]],
                  frozen: tuple[str, ...] = ()) -> ScenarioResult:
    """Runs `body` (the fault, under its own load) with the RSS sampler beside it."""
    deaths_before = {n: p["deaths"] for n, p in (await run.processes()).items()}
    migrations_before = await run.migrations()
    peak: dict[str, int] = {}
    load = Load(run.client, run.load_config, seed=zlib.crc32(name.encode()))
    async with anyio.create_task_group() as tg:
        tg.start_soon(_sample_rss, run, peak)
        recover_s, notes = await body(load)
        tg.cancel_scope.cancel()
    await anyio.sleep(1.0 if run.quick else 3.0)
    after = await run.processes()
    deaths = {n: p["deaths"] - deaths_before.get(n, 0) for n, p in after.items()}
    migrations, resume_s = (await run.migrations()).since(migrations_before)
    statuses: dict[str, int] = {}
    for result in load.results:
        key = str(result.status) if result.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    return ScenarioResult(
        name=name, description=description, sent=load.sent, outcomes=counts(load.results),
        statuses=statuses, killed=killed, frozen=frozen,
        deaths={n: d for n, d in deaths.items() if d},
        rss_start=dict(run.rss_start), rss_peak=peak, rss_after=await run.rss(),
        recover_s=recover_s, max_after_admission_s=_after_admission(load.results, name),
        notes=tuple(notes), migrations=migrations, resume_s=resume_s,
        error_samples=_error_samples(load.results))


def _error_samples(results: list[Result], count: int = 3) -> tuple[str, ...]:
    """The first `count` distinct explicit errors, status and body, request ids masked."""
    seen: dict[str, None] = {}
    for result in results:
        if result.outcome == "error" and len(seen) < count:
            detail = re.sub(r"req-[0-9a-f]+-[0-9.m]+", "req-…", result.detail)
            seen[f"{result.status}: {detail}"] = None
    return tuple(seen)


def _after_admission(results: list[Result], name: str) -> float | None:
    if not name.startswith("overload"):
        return None
    spans = [r.done - r.admitted for r in results if r.admitted is not None]
    return max(spans) if spans else None


async def _sample_rss(run: Run, peak: dict[str, int]) -> None:
    while True:
        for name, value in (await run.rss()).items():
            peak[name] = max(peak.get(name, 0), value)
        await anyio.sleep(0.5)


# The scenarios.

def kill_scenario(services: tuple[str, ...], kind: str) -> Scenario:
    """kill -9 of `services` at once, mid-stream, and their return."""
    async def go(run: Run) -> ScenarioResult:
        async def body(load: Load) -> tuple[float | None, list[str]]:
            window = 6.0 if run.quick else 12.0
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.run, window)
                await anyio.sleep(2.0)
                processes = await run.processes()
                old_pids = {name: processes[name]["pid"] for name in services}
                killed_at = time.monotonic()
                for name in services:
                    await run.faults.kill(name)
                recover = await run.recovered(killed_at, services, old_pids)
            return recover, [f"kill -9 at 2 s of a {window:.0f} s load at "
                             f"{run.load_config.rate:.2f} req/s"]
        return await measure(run, f"kill-{kind}", f"kill -9 of {' and '.join(services)} "
                             f"({kind}) mid-stream and {'their' if len(services) > 1 else 'its'}"
                             " return", services, body)
    return go


# A freeze outlasts the router's notice of it (a missed status poll, then silence_s of no
# progress: services/router/config.py SILENCE_S), so the requests on the worker must move.
FREEZE_S = 12.0
FREEZE_BURST = 2
PARTITION_S = 10.0


def freeze_scenario(service: str, kind: str, pin: float | None = None) -> Scenario:
    """SIGSTOP of `service` mid-stream (alive, its connections open, silent: what a hung host
    looks like from the router), a burst of FREEZE_BURST requests at once (placed before the
    router has missed a status poll of it, some land there), SIGCONT after FREEZE_S, and its
    return. `pin`: the router's t during the scenario (1e12: every prompt prefilled in PD)."""
    async def go(run: Run) -> ScenarioResult:
        async def body(load: Load) -> tuple[float | None, list[str]]:
            await run.faults.pin_threshold(pin)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(load.run, FREEZE_S + 6.0)
                    await anyio.sleep(2.0)
                    await run.faults.freeze(service)
                    try:
                        tg.start_soon(load.burst, FREEZE_BURST)
                        await anyio.sleep(FREEZE_S)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await run.faults.wake(service)
                    woke = time.monotonic()
                    recover = await run.recovered(woke, (service,))
            finally:
                await run.faults.pin_threshold(None)
            return recover, [f"SIGSTOP at 2 s of a {FREEZE_S + 6.0:.0f} s load at "
                             f"{run.load_config.rate:.2f} req/s, {FREEZE_BURST} requests at "
                             f"once then, SIGCONT {FREEZE_S:.0f} s after the SIGSTOP"
                             + ("" if pin is None else ", every prompt prefilled in PD")
                             + "; time to recover runs from the SIGCONT"]
        return await measure(run, f"freeze-{kind}", f"{service} ({kind}) frozen mid-stream "
                             "(SIGSTOP: alive and silent) and woken", (), body, (service,))
    return go


async def partition(run: Run) -> ScenarioResult:
    async def body(load: Load) -> tuple[float | None, list[str]]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, PARTITION_S + 4.0)
            await anyio.sleep(1.0)
            proxy = await run.faults.partition()
            try:
                await anyio.sleep(PARTITION_S)
            finally:
                with anyio.CancelScope(shield=True):
                    await run.faults.heal(proxy)
            healed = time.monotonic()
            recover = await run.recovered(healed)
        return recover, [f"the link's Toxiproxy timeout toxic (an outage that holds the data "
                         f"in flight) for {PARTITION_S:.0f} s at 1 s, then removed"]
    return await measure(run, "partition", "the link partitioned (the emulator's outage on "
                         "one host), then healed", (), body)


async def cachedir_restart(run: Run) -> ScenarioResult:
    async def body(load: Load) -> tuple[float | None, list[str]]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, 6.0 if run.quick else 10.0)
            await anyio.sleep(2.0)
            old_pid = (await run.processes())["cachedir"]["pid"]
            at = time.monotonic()
            await run.faults.restart("cachedir")
            recover = await run.recovered(at, ("cachedir",), {"cachedir": old_pid})
        return recover, ["planned restart (SIGTERM, start at once) at 2 s"]
    return await measure(run, "cachedir-restart", "restart of the cache directory under load",
                         ("cachedir",), body)


def link_scenario(kind: str) -> Scenario:
    async def go(run: Run) -> ScenarioResult:
        async def body(load: Load) -> tuple[float | None, list[str]]:
            fault_s = 4.0 if run.quick else 10.0
            before = await run.faults.link_state()
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.run, fault_s + 4.0)
                await anyio.sleep(1.0)
                if kind == "down":
                    await run.faults.link_update(up=False)
                else:
                    await run.faults.link_update(bandwidth_bps=1000)
                await anyio.sleep(fault_s)
                restored = time.monotonic()
                if kind == "down":
                    await run.faults.link_update(up=True)
                else:
                    await run.faults.link_reset()
                    await run.faults.link_update(bandwidth_bps=before.get("bandwidth_bps"))
                recover = await run.recovered(restored)
            return recover, [f"link {kind} for {fault_s:.0f} s, then restored"]
        what = "down" if kind == "down" else "trickling at 1000 bit/s"
        return await measure(run, f"link-{kind}", f"the link {what}, then restored", (), body)
    return go


def overload_scenario(factor: int) -> Scenario:
    async def go(run: Run) -> ScenarioResult:
        async def body(load: Load) -> tuple[float | None, list[str]]:
            at = time.monotonic()
            await load.burst(factor * run.max_inflight)
            return await run.recovered(at), [f"{factor * run.max_inflight} requests at once "
                                             f"(admission limit {run.max_inflight})"]
        return await measure(run, f"overload-{factor}x", f"{factor}x the admission limit at "
                             "once", (), body)
    return go


async def fuzz_frames(run: Run) -> ScenarioResult:
    count = 1000 if run.quick else 10_000
    rng = random.Random(7)
    frames = random_frames(rng, count // 2) + envelope_frames(count - count // 2, rng)
    rng.shuffle(frames)

    async def body(load: Load) -> tuple[float | None, list[str]]:
        assert run.mesh.urls is not None
        refused: dict[str, int] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, 3.0)
            for name, port in run.mesh.urls.mesh_ports.items():
                refused[name] = await fire_frames(port, frames, rng)
        at = time.monotonic()
        return await run.recovered(at), [
            f"{len(frames)} frames (half random bytes, half hypothesis-built envelopes) at "
            f"each of {len(refused)} mesh ports; connections reset per port: {refused}"]
    return await measure(run, "fuzz-frames", "fuzzed mesh frames at every mesh port", (),
                         body)


async def malformed_http(run: Run) -> ScenarioResult:
    count = 200 if run.quick else 1000
    bodies = malformed_bodies(random.Random(11), count)

    async def body(load: Load) -> tuple[float | None, list[str]]:
        limiter = anyio.CapacityLimiter(16)

        async def one(index: int, content: bytes) -> None:
            path = "/v1/completions" if index % 2 == 0 else "/v1/chat/completions"
            async with limiter:
                load.results.append(await send_raw(run.client, path, content, 30.0))

        async with anyio.create_task_group() as tg:
            for index, content in enumerate(bodies):
                load.sent += 1
                tg.start_soon(one, index, content)
        at = time.monotonic()
        return await run.recovered(at), [f"{count} malformed bodies, 16 at a time"]
    return await measure(run, "malformed-http", "malformed HTTP bodies at the API", (), body)


Scenario = Callable[[Run], Awaitable[ScenarioResult]]
SCENARIOS: dict[str, Scenario] = {
    "kill-decode": kill_scenario(("pd-decode-0",), "decode"),
    "kill-prefill-prfaas": kill_scenario(("prfaas-prefill-0",), "prefill-prfaas"),
    "kill-prefill-pd": kill_scenario(("pd-prefill-0",), "prefill-pd"),
    "kill-decode-and-prefill": kill_scenario(("pd-decode-0", "prfaas-prefill-0"),
                                             "decode-and-prefill"),
    "freeze-decode": freeze_scenario("pd-decode-0", "decode", pin=1e12),
    "freeze-prefill": freeze_scenario("pd-prefill-0", "prefill", pin=1e12),
    "cachedir-restart": cachedir_restart,
    "link-down": link_scenario("down"),
    "link-trickle": link_scenario("trickle"),
    "partition": partition,
    "overload-3x": overload_scenario(3),
    "overload-10x": overload_scenario(10),
    "fuzz-frames": fuzz_frames,
    "malformed-http": malformed_http,
}
