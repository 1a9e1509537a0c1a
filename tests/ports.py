"""Ports for tests that start services on fixed ports (a topology names them), in one place.

`free_port` and `ephemeral_ports`: ports the kernel picks, free right now, released at once.
`free_ports`: each port comes with the 15 after it free and handed to nobody else in the same
call: any of them may be a link's `proxy_base_port`, whose proxy binds one port per worker each
way. Every port is checked free when picked; nothing holds it until the services bind.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack

SPAN = 16


def free_port() -> int:
    """One port free right now (the kernel's pick)."""
    return ephemeral_ports(1)[0]


def ephemeral_ports(count: int) -> list[int]:
    """`count` distinct ports free right now (bound together, then released)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` ports, each the start of SPAN free ports, in disjoint 16-port slots."""
    rng = random.Random()
    chosen: list[int] = []
    for _ in range(200 * n):
        base = rng.randrange(20000 // SPAN, 60000 // SPAN) * SPAN
        if base not in chosen and all(_free(base + i) for i in range(SPAN)):
            chosen.append(base)
            if len(chosen) == n:
                return chosen
    raise RuntimeError(f"could not find {n} free port ranges of {SPAN}")
