"""benchmarks/bench_wire.py never waits out a hang: a warm-up or round past its deadline fails,
naming it. Its figures are the benchmark's business, not this test's."""

from __future__ import annotations

import socket

import pytest
import trio

from mesh.errors import DeadlineExceeded
from mesh.run import Backend, run
from tests.benchmark_scripts import load_benchmark

bench_wire = load_benchmark("bench_wire")


@pytest.mark.trio
async def test_a_mesh_round_past_its_deadline_fails_naming_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    with pytest.raises(bench_wire.RoundOverdue,
                       match=r"^mesh on trio: bulk round 3 of 15 passed its deadline of 30 s"):
        await bench_wire.within(30.0, "mesh on trio: bulk round 3 of 15", trio.sleep_forever)


@pytest.mark.trio
async def test_a_mesh_deadline_inside_a_round_fails_the_round_naming_it() -> None:
    async def stream() -> None:
        raise DeadlineExceeded("stream to server: deadline passed")

    with pytest.raises(bench_wire.RoundOverdue,
                       match=r"^rest round 1 of 5: an operation passed its deadline \(stream"):
        await bench_wire.within(60.0, "rest round 1 of 5", stream)


def test_a_blocked_raw_round_is_unblocked_at_its_deadline_and_fails_naming_it() -> None:
    left, right = socket.socketpair()
    name = "raw blocking sockets: rest round 2 of 5"
    read: list[bytes] = []
    with (left, right, pytest.raises(bench_wire.RoundOverdue, match=rf"^{name} passed"),
          bench_wire.Watchdog(name, 0.2) as dog):
        dog.watch(left)
        # Nothing will ever come: only the watchdog's shutdown ends this read.
        read.append(left.recv(16))
    assert read == [b""]


def test_a_raw_round_within_its_deadline_passes() -> None:
    left, right = socket.socketpair()
    with left, right, bench_wire.Watchdog("raw round", 30.0) as dog:
        dog.watch(left)
        right.sendall(b"ping")
        assert left.recv(16) == b"ping"


@pytest.mark.parametrize("backend", ["trio", "uvloop"])
def test_a_warm_up_that_hangs_fails_naming_its_round(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server that accepts the connection (the kernel's backlog) and never says a word: the
    # client's first stream waits for its handshake until the warm-up's deadline.
    monkeypatch.setattr(bench_wire, "WARM_UP_SECONDS", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        name = f"mesh on {backend}: bulk round 1 of 15"
        with pytest.raises(bench_wire.RoundOverdue,
                           match=rf"^the warm-up of {name} passed its deadline of 0.5 s"):
            run(bench_wire.mesh_bulk_round, [port], 8, name, backend=backend)
