"""Blocking-socket reads that the link benchmarks' senders and sinks share."""

from __future__ import annotations

import socket


def recv_exact(conn: socket.socket, count: int) -> bytes:
    """Exactly `count` bytes from `conn`; ConnectionError if the peer closes before them."""
    data = bytearray()
    while len(data) < count:
        part = conn.recv(count - len(data))
        if not part:
            raise ConnectionError(f"peer closed after {len(data)} of {count} bytes")
        data += part
    return bytes(data)
