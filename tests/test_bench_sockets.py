"""services/bench/sockets: exact reads on a blocking socket."""

from __future__ import annotations

import socket

import pytest

from services.bench.sockets import recv_exact


def test_recv_exact_gathers_the_bytes_across_sends() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"ab")
        left.sendall(b"cde")
        assert recv_exact(right, 4) == b"abcd"
        assert recv_exact(right, 1) == b"e"


def test_recv_exact_names_what_arrived_when_the_peer_closes() -> None:
    left, right = socket.socketpair()
    with right:
        left.sendall(b"abc")
        left.close()
        with pytest.raises(ConnectionError, match="after 3 of 5 bytes"):
            recv_exact(right, 5)
