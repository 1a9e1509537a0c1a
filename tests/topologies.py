"""TOML text of the topologies the tests start: the clusters prfaas and pd, and services whose
names say their roles, on the ports given (not a test module).

A name gives its service's kind and cluster: "router", "cachedir", "link…" (a link), the
short names "p" (a prefill worker in prfaas), "q" (a prefill worker in pd) and "d" (a decode
worker in pd), and "{cluster}-{kind}-{i}" ("pd-decode-0") for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SHORT_NAMES = {"p": ("prefill", "prfaas"), "q": ("prefill", "pd"), "d": ("decode", "pd")}
CLUSTERS = ("prfaas", "pd")
# The router, the cache directory and a worker of each role, on fixed ports (the memory
# transport the in-process meshes run on needs no free ones).
MEMORY_PORTS = {"router": 7100, "cachedir": 7101, "prfaas-prefill-0": 7110, "pd-prefill-0": 7120,
                "pd-decode-0": 7130}


def role(name: str) -> tuple[str, str | None]:
    """The kind and the cluster (None: none) a service's name gives it."""
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    if name in ("router", "cachedir"):
        return name, None
    if name.startswith("link"):
        return "link", None
    cluster, kind, _ = name.split("-")
    return kind, cluster


def table(header: str, fields: Mapping[str, str | int | None], options: str) -> str:
    """One `[[header]]` table: its fields (strings quoted, None left out) and its options (the
    body of an inline table; none if empty)."""
    lines = [f"[[{header}]]"]
    for key, value in fields.items():
        if value is not None:
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}")
    if options:
        lines.append(f"options = {{ {options} }}")
    return "\n".join(lines) + "\n"


def mesh_toml(ports: Mapping[str, int], *, worker: str = "",
                  options: Mapping[str, str] | None = None, link_bps: float | None = None) -> str:
    """The clusters the services are in (each with the options `worker`), a service for each
    of `ports` in its order (with its entry in `options`), and with `link_bps` a link of that
    bandwidth between prfaas and pd, named as the link service."""
    roles = {name: role(name) for name in ports}
    used = {cluster for _, cluster in roles.values()}
    text = [table("clusters", {"name": name, "kind": name}, worker)
            for name in CLUSTERS if name in used]
    for name, port in ports.items():
        kind, cluster = roles[name]
        fields = {"name": name, "kind": kind, "cluster": cluster, "port": port}
        text.append(table("services", fields, (options or {}).get(name, "")))
    if link_bps is not None:
        link = next(name for name, (kind, _) in roles.items() if kind == "link")
        text.append(f'[[links]]\nname = "{link}"\na = "prfaas"\nb = "pd"\n'
                    f"bandwidth_bps = {link_bps:g}\n")
    return "".join(text)


def launched_toml(ports: Sequence[int], *, worker: str, router: str, decoders: int = 1,
                  link_bps: float = 400e6) -> str:
    """The mesh the launcher starts as processes, on free `ports`: [0] the router ([1] its HTTP
    port, and `router` its other options), [2] the cache directory, [3] the link "link-0" ([4]
    its control port, [5] its proxies' first port), then the prefill worker of prfaas, that of
    pd and `decoders` decode workers of pd."""
    workers = ["prfaas-prefill-0", "pd-prefill-0", *(f"pd-decode-{i}" for i in range(decoders))]
    named = {"router": ports[0], "cachedir": ports[2], "link-0": ports[3],
             **dict(zip(workers, ports[6:], strict=False))}
    options = {"router": f"http_port = {ports[1]}, {router}",
               "link-0": f"control_port = {ports[4]}, proxy_base_port = {ports[5]}"}
    return mesh_toml(named, worker=worker, options=options, link_bps=link_bps)
