"""Deployments of equal hardware drawn from one topology, as the paper's Table 6 compares them.

The paper (arXiv 2604.15039 v2, section 4 and Table 6) compares PrfaaS-PD with two baselines:
a homogeneous PD cluster (every prefill instance in the PD cluster) and a naive heterogeneous
one (every prefill on the PrfaaS cluster, every PD instance decodes). From one topology:

- `prfaas-pd`: the topology as it is (N_prfaas / N_p / N_d).
- `homogeneous`: every PrfaaS prefill worker moves into the PD cluster as a PD prefill worker,
  with every option it had (its hardware profile included), so N_p grows by N_prfaas. The
  PrfaaS cluster and its link stay, empty on the PrfaaS side, so the same processes run.
- `naive`: every PD prefill worker becomes a decode worker, so N_d grows by N_p.

Each keeps the number of workers and the hardware of each; only roles and clusters move.
`shape_of` reads a topology's shape back (what a comparison prints).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from mesh.errors import ConfigError
from mesh.topology import ServiceSpec, Topology, topology_toml
from services.paper.case_study import DEPLOYMENTS, HOMOGENEOUS, NAIVE, PRFAAS_PD
from services.service import WORKER_KINDS


def workers(topology: Topology) -> list[ServiceSpec]:
    return [s for s in topology.services if s.kind in WORKER_KINDS]


class Shape(msgspec.Struct, frozen=True):
    """The hardware profile of each worker per stage: PrfaaS prefill, PD prefill, PD decode."""

    prfaas: tuple[str, ...]
    pd_prefill: tuple[str, ...]
    pd_decode: tuple[str, ...]

    @property
    def counts(self) -> tuple[int, int, int]:
        return len(self.prfaas), len(self.pd_prefill), len(self.pd_decode)

    def text(self) -> str:
        """N_prfaas / N_p / N_d as the paper's Table 6 writes it ("-": none)."""
        return " / ".join(str(n) if n else "-" for n in self.counts)

    def stages(self) -> dict[str, str]:
        """Per stage, its workers by profile, e.g. {"pd_prefill": "2 x h20 + 1 x h200"}."""
        return {name: _by_profile(getattr(self, name))
                for name in ("prfaas", "pd_prefill", "pd_decode")}


def _by_profile(profiles: Iterable[str]) -> str:
    counts = Counter(profiles)
    return " + ".join(f"{n} x {p}" for p, n in sorted(counts.items())) or "-"


def shape_of(topology: Topology) -> Shape:
    """The topology's workers per stage, each by its hardware profile ("?" if it names none)."""
    stages: dict[tuple[str, str], list[str]] = {}
    for service in workers(topology):
        profile = str(topology.options_of(service).get("profile", "?"))
        stages.setdefault((topology.cluster_kind(service), service.kind), []).append(profile)
    return Shape(*(tuple(stages.get(key, ())) for key in (
        ("prfaas", "prefill"), ("pd", "prefill"), ("pd", "decode"))))


def deploy(topology: Topology, deployment: str) -> Topology:
    """`topology` redrawn as `deployment` (module docstring); ConfigError if it is unknown."""
    if deployment == PRFAAS_PD:
        return topology
    if deployment == HOMOGENEOUS:
        return _homogeneous(topology)
    if deployment == NAIVE:
        return _naive(topology)
    raise ConfigError(f"deployment must be one of {', '.join(DEPLOYMENTS)}, got {deployment!r}")


def _pd_cluster(topology: Topology) -> str:
    names = [c.name for c in topology.clusters if (c.kind or c.name) == "pd"]
    if len(names) != 1:
        raise ConfigError(f"a homogeneous deployment needs exactly one PD cluster, got {names}")
    return names[0]


def _homogeneous(topology: Topology) -> Topology:
    """Each PrfaaS prefill worker becomes a PD prefill worker with the same effective options
    (the PD cluster's options it does not share are carried as its own)."""
    pd = _pd_cluster(topology)
    pd_options = topology.cluster(pd).options
    moved: dict[str, ServiceSpec] = {}
    names = NameSource(topology)
    for s in workers(topology):
        if topology.cluster_kind(s) == "prfaas" and s.kind == "prefill":
            own = {k: v for k, v in topology.options_of(s).items()
                   if k not in pd_options or pd_options[k] != v}
            moved[s.name] = msgspec.structs.replace(
                s, name=names.next(f"{pd}-prefill"), cluster=pd, options=own)
    return _with_services(topology, moved)


def _naive(topology: Topology) -> Topology:
    """Each PD prefill worker becomes a decode worker of its cluster (options unchanged)."""
    names = NameSource(topology)
    turned = {s.name: msgspec.structs.replace(s, name=names.next(f"{s.cluster}-decode"),
                                              kind="decode")
              for s in workers(topology)
              if topology.cluster_kind(s) == "pd" and s.kind == "prefill"}
    return _with_services(topology, turned)


def _with_services(topology: Topology, changed: dict[str, ServiceSpec]) -> Topology:
    services = tuple(changed.get(s.name, s) for s in topology.services)
    # Construction validates the result again (names, clusters, addresses).
    return Topology(clusters=topology.clusters, services=services, links=topology.links,
                    mesh=topology.mesh)


class NameSource:
    """Fresh service names `stem-i` (the lowest i no service of the topology has yet)."""

    def __init__(self, topology: Topology) -> None:
        self.taken = {s.name for s in topology.services}

    def next(self, stem: str) -> str:
        i = 0
        while f"{stem}-{i}" in self.taken:
            i += 1
        self.taken.add(f"{stem}-{i}")
        return f"{stem}-{i}"


def topology_text(topology: Topology) -> str:
    """The topology as TOML that mesh.topology.parse_topology reads back equal: the file a
    generated deployment runs from (`prfaas serve NAME --topology FILE`)."""
    data = msgspec.to_builtins(topology)
    mesh = {k: v for k, v in data.pop("mesh").items() if v}
    return topology_toml({**data, **({"mesh": mesh} if mesh else {})})
