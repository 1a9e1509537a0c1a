"""The mesh under test: the default topology on free ports, run by `prfaas up` as a child.

The topology is the default one (services/cli/topology.toml) with every port moved to a free
one (so a running demo is left alone), one torch thread per worker and the router's
admission limit set. The model is the default one: the tiny test model's vocabulary (512)
does not fit the byte tokenizer (257), and the router refuses such workers. The Procfile
is the repository's, one line per process, each with `exec` so that its pid is the service's.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec

from mesh.allocator import allocator_env
from mesh.ports import NoFreePorts, free_ports
from mesh.topology import topology_toml
from services.cli.lifeline import child_env
from services.cli.serve import DEFAULT_TOPOLOGY_PATH
from services.contract.access import TOKEN_ENV, bearer_headers

PORT_KEYS = ("port", "http_port", "metrics_port", "control_port", "proxy_base_port")
# Two decode workers: a request whose decode worker is killed continues on the other
# (request migration, services/router/runner.py); one prefill worker per cluster, each the
# other's fallback.
SERVICES = ("cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0",
            "pd-decode-1", "router", "ui")


class ChaosMeshError(Exception):
    """The mesh under test did not start, or its supervisor does not answer."""


class MeshConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_inflight: int = 8  # the router's admission limit (its default is 64)
    # Each worker's prefix cache budget. A cache filling to its budget is not a leak, but a
    # worker restarted by one scenario refills it during the next and the RSS check would
    # count that as growth: a small budget fills during each scenario's warm-up.
    cache_mib: float = 32.0
    ready_timeout_s: float = 180.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 5.0


def free_port(span: int = 1, taken: set[int] | None = None) -> int:
    """A free port whose next `span - 1` ports are free too (a proxy's range), none of them in
    `taken` (ports handed out already but not bound yet); adds them there (mesh.ports)."""
    try:
        return free_ports(1, span, taken)[0]
    except NoFreePorts as exc:
        raise ChaosMeshError(str(exc)) from exc


def chaos_topology(config: MeshConfig) -> dict[str, Any]:
    """The default topology as a dict, ports moved to free ones, the model chosen."""
    data = tomllib.loads(DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))
    data["services"] = [s for s in data["services"] if s["name"] in SERVICES]
    # A link proxies one port per worker each way (services/service.py link_routes).
    workers = sum(s["kind"] in ("prefill", "decode") for s in data["services"])
    taken: set[int] = set()
    for service in data["services"]:
        service["port"] = free_port(1, taken)
        options = service.setdefault("options", {})
        for key in PORT_KEYS[1:]:
            if key in options:
                options[key] = free_port(workers if key == "proxy_base_port" else 1, taken)
        if service["kind"] == "router":
            options["max_inflight"] = config.max_inflight
    for cluster in data["clusters"]:
        cluster["options"]["threads"] = 1
        cluster["options"]["cache_mib"] = config.cache_mib
    return data




def procfile_text(python: str = sys.executable) -> str:
    """The demo's processes, run by this interpreter (the venv's), live mode for speed."""
    return "".join(f"{name}: exec {python} -m services.cli.main serve {name}\n"
                   for name in SERVICES)


class Urls(msgspec.Struct, frozen=True):
    api: str
    link_control: str
    dashboard: str
    supervisor: str
    mesh_ports: dict[str, int]


class ChaosMesh:
    """A running mesh under `prfaas up`: its URLs, token, processes, and their RSS."""

    def __init__(self, workdir: Path, topology: dict[str, Any], token: str) -> None:
        self.workdir, self.topology, self.token = workdir, topology, token
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "mesh.log"
        self.urls: Urls | None = None

    def service(self, name: str) -> dict[str, Any]:
        spec: dict[str, Any] = next(s for s in self.topology["services"] if s["name"] == name)
        return spec

    def headers(self) -> dict[str, str]:
        return bearer_headers(self.token)

    def start(self, config: MeshConfig) -> None:
        (self.workdir / "topology.toml").write_text(topology_toml(self.topology))
        (self.workdir / "Procfile").write_text(procfile_text())
        env = allocator_env({**os.environ, TOKEN_ENV: self.token})
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.cli.main", "up", "--procfile", "Procfile",
                 "--topology", "topology.toml", "--control-port", "0",
                 "--initial-backoff", str(config.initial_backoff_s),
                 "--max-backoff", str(config.max_backoff_s)],
                cwd=self.workdir, env=child_env(env), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        supervisor = self._wait_for_line(r"supervisor: control API on (\S+)/processes",
                                         config.ready_timeout_s)
        self._wait_for_line(r"^ready: ", config.ready_timeout_s)
        self.urls = self._urls(supervisor)

    def _urls(self, supervisor: str) -> Urls:
        router, link, ui = self.service("router"), self.service("link-0"), self.service("ui")
        ports = {s["name"]: s["port"] for s in self.topology["services"]}
        return Urls(f"http://127.0.0.1:{router['options']['http_port']}",
                    f"http://127.0.0.1:{link['options']['control_port']}",
                    f"http://127.0.0.1:{ui['options']['http_port']}", supervisor, ports)

    def _wait_for_line(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            match = regex.search(self.log.read_text(errors="replace"))
            if match:
                return match.group(1) if regex.groups else match.group(0)
            if self.process is not None and self.process.poll() is not None:
                raise ChaosMeshError(f"prfaas up exited with {self.process.returncode}; "
                                     f"see {self.log}")
            time.sleep(0.2)
        raise ChaosMeshError(f"no line matching {pattern!r} in {timeout_s} s; see {self.log}")

    def stop(self) -> int | None:
        """SIGTERM to `prfaas up` (it stops every child in order); its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def processes(self) -> dict[str, dict[str, Any]]:
        """The supervisor's GET /processes, by name."""
        assert self.urls is not None
        response = httpx.get(f"{self.urls.supervisor}/processes", headers=self.headers(),
                             timeout=5.0)
        response.raise_for_status()
        return {p["name"]: p for p in response.json()["processes"]}


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of `pid` from /proc (None when it is gone)."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else None


@contextmanager
def running_mesh(workdir: Path, config: MeshConfig) -> Iterator[ChaosMesh]:
    mesh = ChaosMesh(workdir, chaos_topology(config), secrets.token_urlsafe(16))
    try:
        mesh.start(config)
        yield mesh
    finally:
        mesh.stop()
