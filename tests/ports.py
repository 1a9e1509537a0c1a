"""Ports for tests that start services on fixed ports (a topology names them): mesh.ports'
picker (below the kernel's ephemeral range), with one `taken` set for the whole test process,
so no port is handed out twice. `free_ports(n)` gives each port with the 15 after it free too:
any of them may be a link's `proxy_base_port`, whose proxy binds one port per worker each way.
"""

from __future__ import annotations

from mesh import ports

SPAN = 16
# Every port handed out in this process (module state, as the ports are the process's).
_taken: set[int] = set()


def free_port() -> int:
    """One free port."""
    return ports.free_ports(1, 1, _taken)[0]


def distinct_ports(count: int) -> list[int]:
    """`count` distinct free ports."""
    return ports.free_ports(count, 1, _taken)


def free_ports(n: int, span: int = SPAN) -> list[int]:
    """`n` ports, each the start of `span` free ports, in disjoint slots of `span`."""
    return ports.free_ports(n, span, _taken)
