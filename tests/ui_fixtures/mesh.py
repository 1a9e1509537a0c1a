"""The real default mesh for the dashboard's tests: `prfaas serve` children on free ports.

`topology_text` copies the embedded default topology (services/cli/topology.toml) with every port
moved to a free one and the workers on the tiny random-init model (one torch thread each), so
the whole mesh starts in seconds on two cores; `real_mesh` launches its services, dashboard
included, as child processes (services.cli.launch.launch) and stops them all on the way out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mesh.topology import Options, Scalar, Topology, load_topology
from services.cli.launch import launch
from services.cli.serve import default_topology
from services.service import WORKER_KINDS
from tests.ports import free_port, free_ports

# Services the dashboard shows; echo proves the runtime only.
MESH_SERVICES = ("cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0",
                 "router", "ui")
# Random init, one torch thread each: the mesh shares two cores with chromium. The default
# size, not tiny: the tiny model's vocabulary (512) is not the BPE's, and a random model emits
# ids the router's byte tokenizer (257) cannot decode.
WORKER_OPTIONS: Options = {"checkpoint": "none", "threads": 1}



def free_range(count: int) -> int:
    """The first of `count` consecutive free ports (a link's proxy routes need a range)."""
    return free_ports(1, span=count)[0]


def _moved_options(kind: str, options: Mapping[str, Scalar], workers_b: int) -> Options:
    """A service's options with its ports moved and the tiny model chosen."""
    moved: Options = dict(options)
    for key in options:
        if key == "proxy_base_port":
            moved[key] = free_range(workers_b)
        elif key.endswith("_port"):
            moved[key] = free_port()
    if kind in WORKER_KINDS:
        moved.update(WORKER_OPTIONS)
    return moved


def _value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    # TOML basic strings and numbers read like JSON's.
    return json.dumps(value)


def _table(header: str, fields: Mapping[str, Scalar | Mapping[str, Scalar]]) -> str:
    lines = [f"[[{header}]]"]
    for key, value in fields.items():
        if isinstance(value, Mapping):
            # A dotted option name ("link_estimator.provisioned_bps") is quoted: one key.
            inline = ", ".join(f"{k if re.fullmatch(r'[A-Za-z0-9_-]+', k) else json.dumps(k)}"
                               f" = {_value(v)}" for k, v in value.items())
            lines.append(f"{key} = {{ {inline} }}")
        else:
            lines.append(f"{key} = {_value(value)}")
    return "\n".join(lines) + "\n"


def topology_text(base: Topology | None = None) -> str:
    """TOML of `base` (the embedded default) on free ports, workers on the tiny model."""
    topology = base or default_topology()
    parts = [_table("clusters", {"name": c.name, "kind": c.kind, "options": c.options})
             for c in topology.clusters]
    # A link routes to the workers of both its clusters (b's first, then a's, reversed).
    workers_b = max((len([s for s in topology.services if s.kind in WORKER_KINDS
                          and s.cluster in (link.a, link.b)]) for link in topology.links),
                    default=1)
    for s in topology.services:
        options = _moved_options(s.kind, s.options, workers_b)
        parts.append(_table("services", {"name": s.name, "kind": s.kind, "cluster": s.cluster,
                                         "host": s.host, "port": free_port(),
                                         "options": options}))
    parts += [_table("links", {"name": ln.name, "a": ln.a, "b": ln.b,
                               "bandwidth_bps": ln.bandwidth_bps, "delay_s": ln.delay_s})
              for ln in topology.links]
    return "\n".join(parts)


@dataclass(frozen=True)
class RealMesh:
    topology: Topology
    path: Path  # the topology file the children run
    logs: Path  # one NAME.log per child

    def http_url(self, service: str, option: str = "http_port") -> str:
        spec = self.topology.service(service)
        return f"http://{spec.host}:{spec.options[option]}"

    @property
    def dashboard_url(self) -> str:
        return self.http_url("ui") + "/"

    @property
    def router_url(self) -> str:
        return self.http_url("router")

    @property
    def link_url(self) -> str:
        return self.http_url("link-0", "control_port")


@contextmanager
def real_mesh(root: Path, *, backend: str = "uvloop",
              names: tuple[str, ...] = MESH_SERVICES) -> Iterator[RealMesh]:
    """The default mesh's services as `prfaas serve` children (live mode); all stop on exit."""
    path = root / "topology.toml"
    path.write_text(topology_text(), encoding="utf-8")
    mesh = RealMesh(load_topology(path, ""), path, root)
    with launch(path, names, extra_args=("--backend", backend), log_dir=root, ready_timeout=90):
        yield mesh
