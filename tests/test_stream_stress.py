"""Streams and calls under stress, between two real processes over loopback TCP.

A server process and a client process, each on a backend of its own and (where the host has
two CPUs) pinned to a CPU of its own, as benchmarks/bench_wire.py pins them: the two sides then
run truly at once, which is what it took to lose a frame (docs/engineering-notes.md, "The
stream that hung on trio"). Over one connection the client runs thousands of short operations
from several tasks at once: push streams (`stream_to`), download streams (`open_stream`) and
calls, their items drawn from small messages and bulk payloads just over and far over
mesh.wire.BULK_BYTES (a frame in parts, written by its sender, whose rest the socket may not
take at once). Every operation has a deadline of seconds; one that passes it is counted as
hung. Both sides check every item's sequence number and payload.

The peer program is this file run as a script (`serve` and `drive`); the test starts both
and reads the client's one JSON line. STREAM_STRESS_OPS (default 2000) sets the operations
per backend pair, for a heavier run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
import msgspec
import pytest

from mesh.allocator import allocator_env
from mesh.errors import DeadlineExceeded, MeshError
from mesh.mailbox import Mailbox
from mesh.node import Node, NodeConfig
from mesh.run import BACKENDS, Backend, run
from mesh.server import Context
from mesh.tcp import asyncio_stream, trio_stream
from mesh.transport import Address, TcpTransport
from mesh.wire import BULK_BYTES, Codec

HOST = "127.0.0.1"
OPS = int(os.environ.get("STREAM_STRESS_OPS", "2000"))
# Each operation's deadline: none takes more than a fraction of a second when all is well.
DEADLINE = 5.0
# The client starts no new operation after this long (a run full of hangs still ends).
BUDGET = 40.0
TASKS = 6
# Item payload sizes: a small frame; frames in parts just over BULK_BYTES, whose rest after a
# write the socket cut short is under mesh.outbox.BIG_FRAME (the frames queued behind such a
# rest were the ones lost); larger ones, which fill the sockets' buffers so writes are cut.
SIZES = (200, BULK_BYTES + 7, BULK_BYTES + 7, BULK_BYTES + 40_000, 1 << 18, 1 << 20)
# Each connection's kernel send and receive buffers (see small_socket_buffers).
SOCKET_BUFFER = 32 * 1024
BLOB = bytes(range(256)) * ((1 << 20) // 256 + 1)


class Upload(msgspec.Struct, frozen=True, tag=True):
    items: int


class Download(msgspec.Struct, frozen=True, tag=True):
    sizes: list[int]


class Piece(msgspec.Struct, frozen=True, tag=True):
    seq: int
    # A view of BLOB from offset `seq % 256`: large ones travel uncopied (Codec.encode_parts).
    payload: memoryview


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


class Tally(msgspec.Struct, frozen=True, tag=True):
    items: int
    size: int


MESSAGES = (Upload, Download, Piece, Ping, Tally)


def piece(seq: int, size: int) -> Piece:
    start = seq % 256
    return Piece(seq, memoryview(BLOB)[start : start + size])


def check_piece(item: msgspec.Struct, seq: int) -> int:
    """The payload's size; ValueError if `item` is not piece `seq` as `piece` made it."""
    if not isinstance(item, Piece) or item.seq != seq:
        raise ValueError(f"expected piece {seq}, got {item!r:.80}")
    payload = item.payload
    start = seq % 256
    if payload[:16] != BLOB[start : start + 16] or payload[-1] != BLOB[start + len(payload) - 1]:
        raise ValueError(f"piece {seq}: payload of {len(payload)} bytes is not its own")
    return len(payload)


# The server ------------------------------------------------------------------------------


def server_node() -> Node:
    node = Node("server", Codec(MESSAGES), TcpTransport(), {})

    @node.accepts_stream(Upload)
    async def on_upload(first: Upload, items: Mailbox[msgspec.Struct], ctx: Context) -> Tally:
        seq = size = 0
        async for item in items:
            size += check_piece(item, seq)
            seq += 1
        if seq != first.items:
            raise ValueError(f"upload announced {first.items} items, brought {seq}")
        return Tally(seq, size)

    @node.serves_stream(Download)
    async def on_download(msg: Download, ctx: Context) -> AsyncGenerator[msgspec.Struct, None]:
        for seq, size in enumerate(msg.sizes):
            yield piece(seq, size)

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Ping:
        if msg.n % 5 == 0:
            # Suspends: the reader task hands the connection to a new one (mesh.server).
            await anyio.sleep(0)
        return msg

    return node


async def serve() -> None:
    node = server_node()
    async with node:
        address = await node.listen(Address(HOST, 0))
        print(address.port, flush=True)
        await anyio.sleep_forever()


# The client ------------------------------------------------------------------------------


class Outcome(msgspec.Struct):
    done: int = 0
    hung: int = 0
    failed: int = 0
    bytes: int = 0
    # The first few operations that did not complete, described.
    problems: list[str] = msgspec.field(default_factory=list)


async def upload(node: Node, sizes: list[int]) -> int:
    async with node.stream_to("server", Upload(len(sizes)), timeout=DEADLINE) as sink:
        for seq, size in enumerate(sizes):
            await sink.send(piece(seq, size))
    if sink.result != Tally(len(sizes), sum(sizes)):
        raise ValueError(f"upload of {sizes} answered {sink.result!r}")
    return sum(sizes)


async def download(node: Node, sizes: list[int]) -> int:
    total = seq = 0
    async with node.open_stream("server", Download(sizes), timeout=DEADLINE) as items:
        async for item in items:
            total += check_piece(item, seq)
            seq += 1
    if seq != len(sizes):
        raise ValueError(f"download of {len(sizes)} items ended after {seq}")
    return total


async def ping(node: Node, n: int) -> int:
    if await node.call("server", Ping(n), Ping, timeout=DEADLINE) != Ping(n):
        raise ValueError(f"ping {n} answered wrongly")
    return 0


async def one_operation(node: Node, rng: random.Random, n: int) -> int:
    """A random operation: an upload, a download or a call; the payload bytes it moved."""
    kind = rng.random()
    sizes = [rng.choice(SIZES) for _ in range(rng.randint(1, 6))]
    if kind < 0.4:
        return await upload(node, sizes)
    if kind < 0.7:
        return await download(node, sizes)
    return await ping(node, n)


async def drive(port: int, ops: int, seed: int) -> Outcome:
    outcome = Outcome()
    peers = {"server": Address(HOST, port)}
    stop_at = time.monotonic() + BUDGET
    counter = iter(range(ops))
    async with Node("client", Codec(MESSAGES), TcpTransport(), peers, NodeConfig()) as node:

        async def worker(rng: random.Random) -> None:
            for n in counter:
                if time.monotonic() > stop_at:
                    return
                try:
                    moved = await one_operation(node, rng, n)
                    outcome.bytes += moved
                    outcome.done += 1
                except (MeshError, ValueError) as exc:
                    if isinstance(exc, DeadlineExceeded):
                        outcome.hung += 1
                    else:
                        outcome.failed += 1
                    if len(outcome.problems) < 5:
                        outcome.problems.append(f"operation {n}: {type(exc).__name__}: {exc}")

        async with anyio.create_task_group() as group:
            for task in range(TASKS):
                group.start_soon(worker, random.Random(seed * 100 + task))
    return outcome


# The test --------------------------------------------------------------------------------


def cpus() -> tuple[int | None, int | None]:
    """(client CPU, server CPU): two different CPUs where the host lets us pin."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    mine = sorted(os.sched_getaffinity(0))
    return (mine[0], mine[1]) if len(mine) >= 2 else (None, None)


def peer(role: str, backend: Backend, cpu: int | None, *args: str) -> list[str]:
    pin = [] if cpu is None else ["--cpu", str(cpu)]
    return [sys.executable, __file__, role, "--backend", backend, *pin, *args]


def stress(client: Backend, server: Backend, ops: int, seed: int) -> dict[str, Any]:
    """Runs a server and a client process; the client's outcome as a dict."""
    client_cpu, server_cpu = cpus()
    env = allocator_env(os.environ)
    with subprocess.Popen(peer("serve", server, server_cpu), stdout=subprocess.PIPE,
                          text=True, env=env) as serving:
        try:
            assert serving.stdout is not None
            port = serving.stdout.readline().strip()
            assert port.isdigit(), f"the server did not start: {port!r}"
            command = peer("drive", client, client_cpu, "--port", port, "--ops", str(ops),
                           "--seed", str(seed))
            done = subprocess.run(command, capture_output=True, text=True, env=env,
                                  timeout=BUDGET + 3 * DEADLINE, check=False)
        finally:
            serving.terminate()
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize(
    ("client", "server"), [("trio", "trio"), ("trio", "uvloop"), ("uvloop", "trio")]
)
def test_thousands_of_streams_and_calls_on_one_connection_all_complete(
    client: Backend, server: Backend
) -> None:
    outcome = stress(client, server, OPS, seed=29)
    assert outcome["hung"] == 0 and outcome["failed"] == 0, outcome
    assert outcome["done"] == OPS, outcome


def small_socket_buffers() -> None:
    """Every connection of this process gets socket buffers of SOCKET_BUFFER bytes.

    A write of a frame in parts then nearly always comes back cut, often leaving a rest under
    mesh.outbox.BIG_FRAME with frames queued behind it: the case that lost frames, made
    common instead of depending on how busy the host is (with the kernel's default buffers the
    old outbox hung in runs on a loaded host and passed on an idle one).
    """
    for module in (trio_stream, asyncio_stream):
        tuned = module.tune

        def tune(sock: socket.socket, tuned: Callable[[socket.socket], None] = tuned) -> None:
            tuned(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)

        module.tune = tune  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=["serve", "drive"])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--ops", type=int, default=OPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    small_socket_buffers()
    if args.role == "serve":
        run(serve, backend=args.backend)
        return
    started = time.monotonic()
    outcome = run(drive, args.port, args.ops, args.seed, backend=args.backend)
    report = {**msgspec.to_builtins(outcome), "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
