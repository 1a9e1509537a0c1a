"""Ports for tests that start services on fixed ports (a topology names them), in one place.

Every port is picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range): there no
outgoing connection's source port can take it between the pick and the moment the service binds
it, or binds it again after a restart (a test mesh makes connections all the time, and a port
picked by binding port 0 lies in that range). Each is checked free when picked, and this process
never hands the same port out twice. `free_ports(n)` gives each port with the 15 after it free
too: any of them may be a link's `proxy_base_port`, whose proxy binds one port per worker each
way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

SPAN = 16
LOW = 10000
# This process's picks: a port handed out is never handed out again (module state, as the
# ports themselves are shared by every test in the process).
_handed_out: set[int] = set()


def free_port() -> int:
    """One free port."""
    return free_ports(1, span=1)[0]


def distinct_ports(count: int) -> list[int]:
    """`count` distinct free ports."""
    return free_ports(count, span=1)


def free_ports(n: int, span: int = SPAN) -> list[int]:
    """`n` ports, each the start of `span` free ports, in disjoint slots of `span`."""
    rng = random.Random()
    high = max(LOW + 4096, _ephemeral_low())
    chosen: list[int] = []
    for _ in range(200 * n):
        base = rng.randrange(LOW // span, high // span) * span
        ports = range(base, base + span)
        if _handed_out.isdisjoint(ports) and all(_free(port) for port in ports):
            _handed_out.update(ports)
            chosen.append(base)
            if len(chosen) == n:
                return chosen
    raise RuntimeError(f"could not find {n} free port ranges of {span} below {high}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
