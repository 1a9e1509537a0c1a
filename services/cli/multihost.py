"""`prfaas multihost`: one topology across network namespaces, the rehearsal of two machines.

    prfaas multihost [--procfile Procfile] [--topology FILE] [--kv emulator|direct]

Makes two namespaces for the run (netem/netns.py): the PrfaaS cluster (its workers and the
link service) in one, the PD cluster (router, cache directory, PD workers, the dashboard) in
the other, joined by a veth pair whose both directions the kernel shapes to the topology's
first link's bandwidth (tbf); the client and the browser stay in the root namespace, joined
to each by a veth of its own. The link's delay, jitter and loss are the kernel's too where it
has the netem qdisc (probed once per run: netem at the root, the tbf its child; the link's
options.impairments set to "kernel", so the emulator adds none of them again); where it has
not, they stay with the project's link emulator, and one line of the run's output says so.
Each namespace runs `prfaas up --here ITS_SHARE` with one topology file, its services'
addresses rewritten to 198.18.x.y (`MULTIHOST_HOSTS`), and the same admin token and mesh
secret (generated unless the environment has them). KV crosses the shaped veth through the
project's link emulator, or straight with `--kv direct` (the link's options.kv,
services/service.py `resolve_from`).

Prints `ready: dashboard http://198.18.0.2:8080/?token=... API http://198.18.0.2:8000/v1`
once the router is ready; each namespace's own output is prefixed with `[prfaas]` or `[pd]`.
Ctrl-C or SIGTERM stops both, then removes the namespaces (and with them the veths and
qdiscs); so does a share that exits. A run that was killed leaves names that the next run
removes first (`remove_stale`). Not root, or no namespaces: a message and exit code 3.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import msgspec
from anyio.streams.text import TextReceiveStream

from mesh.errors import MeshError
from mesh.topology import Topology, load_topology, topology_toml
from netem.netns import (
    Impairment,
    NetLab,
    NetnsError,
    Route,
    Veth,
    remove_stale,
    require_netns,
)
from services.cli.lifeline import child_env
from services.cli.procfile import ProcessSpec, load_procfile
from services.cli.serve import DEFAULT_TOPOLOGY_PATH
from services.cli.up import children_env, endpoints, wait_ready
from services.contract.access import TOKEN_ENV
from services.service import KVPath, link_kv_path

PRFAAS, PD = "prfaas", "pd"
# Where each namespace's services listen and are dialled: the two ends of the shaped veth.
MULTIHOST_HOSTS = {PRFAAS: "198.18.0.1", PD: "198.18.0.2"}
# The root namespace's veths to each (root end, namespace end).
ROOT_VETHS = {PRFAAS: ("198.18.1.1", "198.18.1.2"), PD: ("198.18.2.1", "198.18.2.2")}
EXIT_NO_NETNS = 3
STOP_TIMEOUT_S = 20.0


def role_of(topology: Topology, name: str) -> str:
    """The namespace of process `name`: the PrfaaS cluster's services and the link services
    in PRFAAS (KV leaves through the emulator there), everything else in PD."""
    spec = next((s for s in topology.services if s.name == name), None)
    if spec is None:
        return PD
    if spec.kind == "link":
        return PRFAAS
    return PRFAAS if spec.cluster and topology.cluster_kind(spec) == "prfaas" else PD


def shares(topology: Topology, specs: Sequence[ProcessSpec]) -> dict[str, list[str]]:
    """Each namespace's processes of the Procfile, in Procfile order."""
    out: dict[str, list[str]] = {PRFAAS: [], PD: []}
    for spec in specs:
        out[role_of(topology, spec.name)].append(spec.name)
    return out


def multihost_topology(topology: Topology, kv: KVPath) -> Topology:
    """`topology` with every service at its namespace's address (listening there too) and
    every link's KV path set to `kv`."""
    data = msgspec.to_builtins(topology)
    for service in data["services"]:
        service["host"] = MULTIHOST_HOSTS[role_of(topology, service["name"])]
        service.pop("bind", None)
    for link in data.get("links", []):
        link["options"] = {**link.get("options", {}), "kv": kv}
    return msgspec.convert(data, Topology)


def lab_for(topology: Topology, owner: int | None = None) -> NetLab:
    """The namespaces, veths and routes of a run; the cross veth at the first link's rate,
    asking for its delay, jitter and loss."""
    rate, impairment = 0.0, Impairment()
    if topology.links:
        link = topology.links[0]
        rate = link.bandwidth_bps
        impairment = Impairment(link.delay_s, link.jitter_s, link.loss_rate)
    veths = [Veth(PRFAAS, PD, MULTIHOST_HOSTS[PRFAAS], MULTIHOST_HOSTS[PD], rate, impairment)]
    routes = []
    for role, (root_end, far_end) in ROOT_VETHS.items():
        veths.append(Veth(None, role, root_end, far_end))
        routes.append(Route(None, MULTIHOST_HOSTS[role], far_end))
    return NetLab((PRFAAS, PD), veths, routes, owner=owner)


def impaired_by_lab(topology: Topology, lab: NetLab) -> Topology:
    """`topology` with its first link's options.impairments "kernel" when the lab's netem
    adds the link's delay, jitter and loss (the emulator then adds none), else as it was."""
    if not (lab.kernel_impairs and topology.links):
        return topology
    data = msgspec.to_builtins(topology)
    link = data["links"][0]
    link["options"] = {**link.get("options", {}), "impairments": "kernel"}
    return msgspec.convert(data, Topology)


def impairment_note(topology: Topology, lab: NetLab) -> str | None:
    """The run's one line on who adds the cross link's delay, jitter and loss (None: it asks
    for none)."""
    if lab.netem_refusal is None or not topology.links:
        return None
    link = topology.links[0]
    asked = (f"{link.name}'s delay {link.delay_s * 1e3:g} ms, jitter {link.jitter_s * 1e3:g} ms,"
             f" loss {link.loss_rate:.3%}")
    if lab.kernel_impairs:
        return (f"multihost: the kernel's netem adds {asked} on the cross veth (under tbf); "
                "the link emulator adds none of them")
    note = (f"multihost: this kernel has no netem qdisc ({lab.netem_refusal}): {asked} stay "
            "with the project's link emulator")
    if link_kv_path(link) == "direct":
        note += ", which KV does not cross (kv direct): KV crosses without them"
    return note


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas multihost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--procfile", type=Path, default=Path("Procfile"))
    parser.add_argument("--topology", type=Path, help="topology TOML (default: embedded)")
    parser.add_argument("--kv", choices=("emulator", "direct"), default="emulator",
                        help="KV across the clusters through the link emulator, or straight")
    return parser.parse_args(argv)


def multihost_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        base = load_topology(args.topology, DEFAULT_TOPOLOGY_PATH.read_text("utf-8"))
        topology = multihost_topology(base, args.kv)
        split = shares(topology, load_procfile(args.procfile))
        env = children_env(topology, os.environ, generate=True)
    except MeshError as exc:
        print(f"prfaas multihost: {exc}", file=sys.stderr)
        return 2
    try:
        require_netns()
        for name in remove_stale():
            print(f"multihost: removed {name}, left by a run that is gone", flush=True)
        with lab_for(topology) as lab, tempfile.TemporaryDirectory(prefix="pfm-") as tmp:
            topology = impaired_by_lab(topology, lab)
            note = impairment_note(topology, lab)
            if note is not None:
                print(note, flush=True)
            path = Path(tmp) / "topology.toml"
            path.write_text(topology_toml(msgspec.to_builtins(topology)), "utf-8")
            argvs = {role: up_argv(lab, role, names, args.procfile, path)
                     for role, names in split.items() if names}
            return anyio.run(partial(_run, argvs, env, topology, env[TOKEN_ENV]),
                             backend="asyncio")
    except NetnsError as exc:
        print(f"prfaas multihost: {exc}", file=sys.stderr)
        return EXIT_NO_NETNS


def up_argv(lab: NetLab, role: str, names: Sequence[str], procfile: Path, topology: Path
            ) -> list[str]:
    """`prfaas up --here NAMES` in role's namespace."""
    return [*lab.exec_prefix(role), sys.executable, "-m", "services.cli.main", "up",
            "--procfile", str(procfile), "--topology", str(topology),
            "--here", ",".join(names)]


async def _run(argvs: Mapping[str, list[str]], env: dict[str, str], topology: Topology,
               token: str) -> int:
    """Runs every share until a signal or until one exits; the exit code."""
    urls = endpoints(topology)
    code = 0
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            processes = [await anyio.open_process(argv, stdin=None, stdout=-1, stderr=-2,
                                                  env=child_env(env))
                         for argv in argvs.values()]
            for role, process in zip(argvs, processes, strict=True):
                tg.start_soon(_relay, role, process)
            tg.start_soon(_announce, urls.health, f"ready: dashboard {urls.dashboard}"
                          f"?token={token} API {urls.api}")
            async with anyio.create_task_group() as first:
                first.start_soon(_first_signal, signals, first.cancel_scope)
                for role, process in zip(argvs, processes, strict=True):
                    first.start_soon(_first_exit, role, process, first.cancel_scope)
            code = max((p.returncode or 0 for p in processes), default=0)
            await _stop(processes)
            tg.cancel_scope.cancel()
    return 1 if code else 0


async def _relay(role: str, process: anyio.abc.Process) -> None:
    """Prints the share's output, each line prefixed with its namespace."""
    assert process.stdout is not None
    pending = ""
    async for text in TextReceiveStream(process.stdout, errors="replace"):
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            print(f"[{role}] {line}", flush=True)
    if pending:
        print(f"[{role}] {pending}", flush=True)


async def _announce(health_url: str, line: str) -> None:
    await wait_ready(health_url)
    print(line, flush=True)


async def _first_signal(signals: AsyncIterator[int], scope: anyio.CancelScope
                        ) -> None:
    async for signum in signals:
        print(f"multihost: {signal.Signals(signum).name}: stopping both namespaces", flush=True)
        scope.cancel()
        return


async def _first_exit(role: str, process: anyio.abc.Process, scope: anyio.CancelScope) -> None:
    await process.wait()
    print(f"multihost: the {role} namespace's share exited ({process.returncode}): stopping",
          flush=True)
    scope.cancel()


async def _stop(processes: Sequence[anyio.abc.Process]) -> None:
    """SIGTERM to each share (its supervisor stops its processes), SIGKILL after
    STOP_TIMEOUT_S."""
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(STOP_TIMEOUT_S):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.kill()
            await process.wait()
    print("multihost: every share stopped; removing the namespaces", flush=True)
