"""The live mesh `prfaas validate-sim` runs: its topology, its services as `prfaas serve`
processes, and each worker's compute on a CPU of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mesh.ports import free_ports
from mesh.topology import Topology, load_topology
from services.cli.launch import launch
from services.cli.validate.config import ValidationConfig
from services.paper.hardware import (
    CostModel,
)

# The workers whose compute the simulation times, in the order they get a CPU of their own
# (`core_plan`); the cache directory, the link and the driver (the router) share the rest.
WORKERS = ("prfaas-prefill-0", "pd-prefill-0", "pd-decode-0")


def topology_text(config: ValidationConfig) -> str:
    """The live mesh on free ports; the workers' options are the simulation's."""
    p = free_ports(8)
    bs_max, _ = CostModel.load(config.profile, config.model).decode_slo()
    worker = (f'family = "{config.family}", size = "{config.size}", '
              f'checkpoint = "{config.checkpoint}", threads = 1, connections = 1, '
              f"chunk_tokens = {config.chunk_tokens}, snapshot_every = {config.snapshot_every}, "
              f"max_batch = {bs_max}")
    services = [("cachedir", "cachedir", "", p[0], ""),
                ("link-0", "link", "", p[1], f"options = {{ control_port = {p[2]}, "
                                                f"proxy_base_port = {p[3]} }}"),
                ("prfaas-prefill-0", "prefill", "prfaas", p[4], ""),
                ("pd-decode-0", "decode", "pd", p[5], f"options = {{ metrics_port = {p[6]} }}"),
                ("router", "router", "", free_ports(1)[0], "")]
    if config.pd_prefill:
        services.insert(-1, ("pd-prefill-0", "prefill", "pd", p[7], ""))
    text = "".join(f'[[clusters]]\nname = "{c}"\nkind = "{c}"\noptions = {{ {worker} }}\n'
                   for c in ("prfaas", "pd"))
    for name, kind, cluster, port, extra in services:
        text += f'[[services]]\nname = "{name}"\nkind = "{kind}"\nport = {port}\n'
        text += (f'cluster = "{cluster}"\n' if cluster else "") + (extra + "\n" if extra else "")
    return text + (f'[[links]]\nname = "link-0"\na = "prfaas"\nb = "pd"\n'
                   f"bandwidth_bps = {config.bandwidth_bps}\ndelay_s = {config.delay_s}\n")


@contextmanager
def live_mesh(config: ValidationConfig, log_dir: Path) -> Iterator[Topology]:
    """The live mesh's services as `prfaas serve` processes (live mode) until the block ends,
    pinned (`pin_cores`) when the config asks and the machine has two cores or more."""
    path = log_dir / "topology.toml"
    path.write_text(topology_text(config))
    with launch(path, mesh_services(config), log_dir=log_dir,
                ready_timeout=180.0) as children:
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if config.pin and len(mine) >= 2:
            pin_cores({name: child.pid for name, child in children.items()}, sorted(mine))
        try:
            yield load_topology(path, "")
        finally:
            if config.pin and len(mine) >= 2:
                _pin(os.getpid(), mine)


def mesh_services(config: ValidationConfig) -> tuple[str, ...]:
    """The services `prfaas serve` runs for `config` (the router runs in this process)."""
    local = ("pd-prefill-0",) if config.pd_prefill else ()
    return ("cachedir", "link-0", "prfaas-prefill-0", *local, "pd-decode-0")


def core_plan(names: Sequence[str], cpus: Sequence[int]) -> dict[str, set[int]]:
    """The CPUs each service may run on, and this driver's (under ""): the workers, in
    `WORKERS`' order, each get a CPU to themselves while one is left over; every other
    service, the workers left without one, and the driver share what is left. On two CPUs:
    the PrfaaS prefill worker alone on the first, everything else on the second. The
    simulation gives each instance its own hardware; on a small host a worker's compute
    otherwise shares its core with the others, the link proxy and the router whenever they
    are busy, and runs slower the heavier the load. Each worker computes on one torch thread
    (its `threads` option), so one CPU is all its compute uses."""
    workers = [w for w in WORKERS if w in names][:max(len(cpus) - 1, 0)]
    own = {w: {cpus[i]} for i, w in enumerate(workers)}
    rest = set(cpus[len(workers):])
    return {**{name: own.get(name, rest) for name in names}, "": rest}


def pin_cores(pids: dict[str, int], cpus: Sequence[int]) -> None:
    """Every service in `pids` (name to process id) and this driver pinned to its CPUs in
    `core_plan`. Every thread of a process is pinned; threads started later inherit."""
    plan = core_plan(list(pids), cpus)
    for name, pid in pids.items():
        _pin(pid, plan[name])
    _pin(os.getpid(), plan[""])


def _pin(pid: int, cpus: set[int]) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
