"""The port picker (mesh.ports): below the kernel's ephemeral range, never the same port twice."""

from __future__ import annotations

from mesh.ports import LOW, ephemeral_low
from tests.ports import SPAN, distinct_ports, free_port, free_ports


def test_ports_lie_below_the_ephemeral_range_and_never_repeat() -> None:
    ranges = free_ports(3)
    singles = distinct_ports(40) + [free_port() for _ in range(40)]
    every = [p for base in ranges for p in range(base, base + SPAN)] + singles
    assert len(set(every)) == len(every)
    assert all(LOW <= p < max(LOW + 4096, ephemeral_low()) for p in every)
    assert all(base % SPAN == 0 for base in ranges)
