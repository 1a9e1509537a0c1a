"""Topology: which clusters, services, addresses and links make up a mesh.

A TOML file decoded by msgspec into frozen Structs, validated once (duplicate names, unknown
clusters, bad ports, bad link figures) so that services can then find each other by name
(`topology.address("decode-0")`, which a `Node` takes as its resolver). The mesh ships no
default content: an application passes its own embedded default text to `load_topology`,
used when no file is given.

    [[clusters]]
    name = "pd"

    [[services]]
    name = "decode-0"
    kind = "decode"
    cluster = "pd"
    port = 7101
    host = "pd-1.example"        # where peers dial it
    bind = "0.0.0.0"             # where it listens (default: host)

    [[links]]
    name = "wan"
    a = "prfaas"
    b = "pd"
    bandwidth_bps = 100e9
    delay_s = 0.005

    [mesh]
    secret_env = "MESH_SECRET"   # or: secret_file = "/etc/mesh/secret", or secret = "..."

`mesh_secret(topology)` resolves the optional shared secret that a Node takes as `secret`.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from mesh.errors import ConfigError, UnknownPeer
from mesh.membership import check_secret
from mesh.transport import Address

Scalar = str | int | float | bool
Options = dict[str, Scalar]


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A group of services in one place (one datacenter, one rack)."""

    name: str
    kind: str = ""
    options: Options = {}


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One service: its name (how peers call it), kind, cluster ("" for none) and addresses.

    `host` is the address others dial; `bind` the one it listens on ("": `host`), e.g.
    `bind = "0.0.0.0"` behind `host = "pd-1.example"`. Its ports are the same on both.
    """

    name: str
    kind: str
    port: int
    host: str = "127.0.0.1"
    bind: str = ""
    cluster: str = ""
    options: Options = {}

    @property
    def address(self) -> Address:
        """Where peers reach the service."""
        return Address(self.host, self.port)

    @property
    def bind_host(self) -> str:
        """The host the service listens on."""
        return self.bind or self.host

    @property
    def listen_address(self) -> Address:
        """Where the service listens."""
        return Address(self.bind_host, self.port)


class LinkSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A line between two clusters: bandwidth in bits per second, one-way delay in seconds,
    jitter in seconds (each packet's delay drawn uniformly within +-jitter_s of delay_s) and
    loss (the fraction of packets lost)."""

    name: str
    a: str
    b: str
    bandwidth_bps: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss_rate: float = 0.0
    options: Options = {}


class MeshSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the mesh itself: where its shared secret comes from (empty: no secret).

    secret_env names an environment variable holding the secret; secret_file a file holding
    it (one trailing newline is not part of it); secret holds it inline. At most one.
    """

    secret_env: str = ""
    secret_file: str = ""
    secret: str = msgspec.field(default="")

    def __post_init__(self) -> None:
        given = [k for k in ("secret_env", "secret_file", "secret") if getattr(self, k)]
        if len(given) > 1:
            raise ConfigError(f"[mesh]: give one of secret_env, secret_file, secret, not "
                              f"{' and '.join(given)}")

    @property
    def configured(self) -> bool:
        """Whether the topology says where the secret comes from."""
        return bool(self.secret_env or self.secret_file or self.secret)

    def __repr__(self) -> str:
        # The inline secret must not reach logs through a repr.
        hidden = "<hidden>" if self.secret else ""
        return (f"MeshSpec(secret_env={self.secret_env!r}, secret_file={self.secret_file!r}, "
                f"secret={hidden!r})")


def _duplicates(names: Iterable[object]) -> list[object]:
    return [name for name, count in Counter(names).items() if count > 1]


class Topology(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole mesh; construction (and decoding) validates it."""

    clusters: tuple[ClusterSpec, ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    links: tuple[LinkSpec, ...] = ()
    mesh: MeshSpec = MeshSpec()

    def __post_init__(self) -> None:
        for what, names in (
            ("cluster", [c.name for c in self.clusters]),
            ("service", [s.name for s in self.services]),
            ("link", [link.name for link in self.links]),
            ("service address", [str(s.address) for s in self.services]),
        ):
            if repeated := _duplicates(names):
                raise ConfigError(f"duplicate {what} {repeated[0]!r} in topology")
        known = {c.name for c in self.clusters}
        for service in self.services:
            _check_service(service, known)
        for link in self.links:
            _check_link(link, known)

    def service(self, name: str) -> ServiceSpec:
        for service in self.services:
            if service.name == name:
                return service
        raise UnknownPeer(f"service {name!r} is not in the topology")

    def address(self, name: str) -> Address:
        """The address of service `name`: pass `topology.address` to a Node as its resolver."""
        return self.service(name).address

    def cluster(self, name: str) -> ClusterSpec:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise ConfigError(f"cluster {name!r} is not in the topology")

    def options_of(self, service: ServiceSpec) -> Options:
        """The service's options over its cluster's (a service's own win), as it reads them."""
        cluster = self.cluster(service.cluster).options if service.cluster else {}
        return {**cluster, **service.options}

    def cluster_kind(self, service: ServiceSpec) -> str:
        """The kind of the service's cluster; a cluster without a kind goes by its name."""
        cluster = self.cluster(service.cluster)
        return cluster.kind or cluster.name

    def find(self, *, kind: str | None = None, cluster: str | None = None) -> list[ServiceSpec]:
        """Services of a kind and/or in a cluster, in file order."""
        return [
            s for s in self.services
            if (kind is None or s.kind == kind) and (cluster is None or s.cluster == cluster)
        ]

    def links_between(self, a: str, b: str) -> list[LinkSpec]:
        """Links joining clusters a and b, either way round."""
        return [link for link in self.links if {link.a, link.b} == {a, b}]


def mesh_secret(
    topology: Topology, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The topology's shared secret as bytes (UTF-8), or None when it configures none.

    ConfigError if `[mesh] secret_env` names a variable that is unset or empty in `environ`
    (default os.environ), if `secret_file` cannot be read, or if the secret is shorter than
    mesh.membership.MIN_SECRET.
    """
    spec = topology.mesh
    if spec.secret_file:
        return check_secret(_read_secret_file(spec.secret_file))
    if spec.secret_env:
        value = (os.environ if environ is None else environ).get(spec.secret_env, "")
        if not value:
            raise ConfigError(f"[mesh] secret_env: environment variable {spec.secret_env!r} "
                              "is not set")
        return check_secret(value.encode())
    return check_secret(spec.secret.encode()) if spec.secret else None


def _read_secret_file(path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"[mesh] secret_file {path!r}: {exc.strerror}") from exc
    return data.removesuffix(b"\n")


def _check_service(service: ServiceSpec, clusters: set[str]) -> None:
    if service.cluster and service.cluster not in clusters:
        raise ConfigError(f"service {service.name!r}: unknown cluster {service.cluster!r}")
    if not 1 <= service.port <= 65535:
        raise ConfigError(f"service {service.name!r}: port must be 1..65535, got {service.port}")


def _check_link(link: LinkSpec, clusters: set[str]) -> None:
    for end in (link.a, link.b):
        if end not in clusters:
            raise ConfigError(f"link {link.name!r}: unknown cluster {end!r}")
    if link.a == link.b:
        raise ConfigError(f"link {link.name!r}: joins cluster {link.a!r} to itself")
    if not link.bandwidth_bps > 0:
        bad = link.bandwidth_bps
        raise ConfigError(f"link {link.name!r}: bandwidth_bps must be > 0, got {bad}")
    if not link.delay_s >= 0:
        raise ConfigError(f"link {link.name!r}: delay_s must be >= 0, got {link.delay_s}")
    if not link.jitter_s >= 0:
        raise ConfigError(f"link {link.name!r}: jitter_s must be >= 0, got {link.jitter_s}")
    if not 0 <= link.loss_rate <= 1:
        raise ConfigError(f"link {link.name!r}: loss_rate must be in [0, 1], got "
                          f"{link.loss_rate}")


def parse_topology(text: str, source: str = "<string>") -> Topology:
    """Decodes and validates TOML text; ConfigError names the source and the bad value."""
    try:
        return msgspec.toml.decode(text, type=Topology)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc


def load_topology(path: str | Path | None, default: str) -> Topology:
    """The topology in file `path`, or the caller's embedded `default` text when path is None."""
    if path is None:
        return parse_topology(default, "<default topology>")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"topology file {str(path)!r}: {exc.strerror}") from exc
    return parse_topology(text, str(path))


def topology_toml(data: Mapping[str, object]) -> str:
    """Topology data (a file as parsed, or `msgspec.to_builtins` of a Topology) as TOML that
    `parse_topology` reads back equal: arrays of tables (a list) and tables (a dict) of
    scalars and inline tables, all a topology file holds."""
    lines: list[str] = []
    for section, value in data.items():
        tables = value if isinstance(value, list | tuple) else [value]
        header = f"[[{section}]]" if isinstance(value, list | tuple) else f"[{section}]"
        for table in tables:
            assert isinstance(table, Mapping)
            lines += [header, *(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()),
                      ""]
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    """A bare key as it is; any other (a dotted option name) quoted, so it stays one key."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        # A topology's numbers are finite (this module validates ports, bandwidths, delays).
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a TOML basic string (the same escapes).
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise ConfigError(f"topology value {value!r} has no TOML form")
