"""Ports to hand to services that bind them later (a topology names them), from one picker.

Picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range): there no outgoing
connection's source port can take a port between the pick and the moment its service binds it,
or binds it again after a restart (a mesh makes connections all the time, and a port got by
binding port 0 lies in that range). Each is checked free when picked; a caller that picks
several times passes one `taken` set, so no port is handed out twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from mesh.errors import MeshError

LOW = 10000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NoFreePorts(MeshError):
    """No free ports as asked could be found below the ephemeral range."""


def free_ports(n: int, span: int = 1, taken: set[int] | None = None) -> list[int]:
    """`n` ports, each the first of `span` free ports in its own slot of `span`, none in
    `taken`; all `n * span` of them are added to `taken`."""
    taken = set() if taken is None else taken
    high = max(LOW + 4096, ephemeral_low())
    rng = random.Random()
    chosen: list[int] = []
    for _ in range(200 * n):
        base = rng.randrange(LOW // span, high // span) * span
        ports = range(base, base + span)
        if taken.isdisjoint(ports) and all(_free(port) for port in ports):
            taken.update(ports)
            chosen.append(base)
            if len(chosen) == n:
                return chosen
    raise NoFreePorts(f"could not find {n} free port ranges of {span} below {high}")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
