"""What both of the mesh's TCP streams share: the bulk read step and the socket set-up."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import anyio.abc

# The rest of a bulk frame is read into its buffer this much at a time. Reading loopback TCP
# in steps of 64 KiB made the *sender* cheaper per byte than reading up to 1 MiB at once, and
# the reader too: a blocking sender to a blocking `recv_into`, 4.9 against 4.0 GB/s; the mesh
# on trio 4.95 against 3.15, on uvloop 4.67 against 3.31, sender and receiver CPU per GiB
# both lower (docs/engineering-notes.md 3a).
BULK_READ = 64 * 1024


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Nagle would hold a small reply back until the previous segment is acknowledged.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def attributes(sock: socket.socket) -> dict[Any, Callable[[], Any]]:
    attribute = anyio.abc.SocketAttribute
    return {
        attribute.raw_socket: lambda: sock,
        attribute.family: lambda: sock.family,
        attribute.local_address: sock.getsockname,
        attribute.remote_address: sock.getpeername,
    }
