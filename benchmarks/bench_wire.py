"""Wire benchmark: the mesh over loopback TCP against raw blocking sockets, in the same run.

Three servers run as subprocesses (so sender and receiver each get a core, as in a real
deployment): a raw blocking-socket server, a mesh node on trio, a mesh node on asyncio+uvloop.
The client (this process) measures, for each:
  bulk   1 MiB frames: raw `sendall` of encoded frames vs `node.stream_to` items; GB/s
  small  ~200-byte messages: raw, one `sendall` each; mesh, `node.cast` (batched by the outbox)
  rtt    ~200-byte request/reply: raw send+recv vs `node.call`; microseconds per round trip
  bare anyio rtt: the same bytes echoed by plain anyio streams in the mesh server's process
         (no mesh), i.e. the event loop's own share of the mesh round trip
Both sides encode and decode every message with msgspec (the raw side with a plain length
prefix and the same message Structs). Each figure is the median of several repetitions taken
in turns, since the 2-vCPU host has slow windows (stack.md G12). Every process runs with
MALLOC_TOP_PAD_=64 MiB: without it glibc trims and regrows the heap per received chunk
(stack.md G3). The last line printed is one JSON object.

    .venv/bin/python benchmarks/bench_wire.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh.node import Node, NodeConfig
from mesh.run import Backend, run
from mesh.server import Context
from mesh.transport import Address, TcpTransport
from mesh.wire import Codec

MALLOC_PAD = "67108864"
PAYLOAD = b"\xa5" * (1 << 20)
HOST = "127.0.0.1"


class Chunk(msgspec.Struct, frozen=True, tag=True):
    seq: int
    payload: bytes


class Small(msgspec.Struct, frozen=True, tag=True):
    seq: int
    kind: str
    request_id: str
    ts: float
    tokens: list[int]
    note: str


class Begin(msgspec.Struct, frozen=True, tag=True):
    frames: int


class Count(msgspec.Struct, frozen=True, tag=True):
    n: int


MESSAGES = (Chunk, Small, Begin, Count)


def small(seq: int) -> Small:
    """A control-sized message: about 200 bytes encoded."""
    return Small(seq, "decode", f"req-{seq:012d}", 1234.5678, list(range(1000, 1016)), "n" * 60)


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def frame_of(msg: msgspec.Struct) -> bytes:
    return frame(msgspec.msgpack.encode(msg))


# Raw blocking-socket side ----------------------------------------------------------------


def raw_serve(conn: socket.socket) -> None:
    """Counts Chunk bytes and Small casts; echoes Small 'rtt'; answers Count with the tally."""
    decoder = msgspec.msgpack.Decoder(Chunk | Small | Count)
    encoder = msgspec.msgpack.Encoder()
    buf = bytearray()
    tally = 0
    while data := conn.recv(1 << 20):
        buf += data
        pos = 0
        while len(buf) - pos >= 4:
            size = int.from_bytes(buf[pos : pos + 4], "big")
            if len(buf) - pos - 4 < size:
                break
            msg = decoder.decode(memoryview(buf)[pos + 4 : pos + 4 + size])
            pos += 4 + size
            if isinstance(msg, Chunk):
                tally += len(msg.payload)
            elif isinstance(msg, Count):
                conn.sendall(frame(encoder.encode(Count(tally))))
                tally = 0
            elif msg.kind == "rtt":
                conn.sendall(frame(encoder.encode(msg)))
            else:
                tally += 1
        del buf[:pos]


class RawClient:
    """The blocking client; `read` parses one reply frame."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Small | Count)
        self.buf = bytearray()

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.sendall(frame(self.encoder.encode(msg)))

    def read(self) -> Small | Count:
        while True:
            if len(self.buf) >= 4:
                size = int.from_bytes(self.buf[:4], "big")
                if len(self.buf) >= 4 + size:
                    msg: Small | Count = self.decoder.decode(self.buf[4 : 4 + size])
                    del self.buf[: 4 + size]
                    return msg
            self.buf += self.sock.recv(1 << 20)

    def bulk(self, frames: int) -> float:
        start = time.perf_counter()
        for seq in range(frames):
            self.send(Chunk(seq, PAYLOAD))
        self.send(Count(0))
        assert self.read() == Count(frames * len(PAYLOAD))
        return frames * len(PAYLOAD) / (time.perf_counter() - start)

    def small(self, n: int) -> float:
        start = time.perf_counter()
        for seq in range(n):
            self.send(small(seq))
        self.send(Count(0))
        assert self.read() == Count(n)
        return n / (time.perf_counter() - start)

    def rtt(self, n: int) -> float:
        msg = msgspec.structs.replace(small(0), kind="rtt")
        start = time.perf_counter()
        for _ in range(n):
            self.send(msg)
            self.read()
        return (time.perf_counter() - start) / n


def serve_raw() -> None:
    with socket.create_server((HOST, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                raw_serve(conn)


# Mesh side -------------------------------------------------------------------------------


def mesh_server_node() -> Node:
    # One worker keeps casts and the closing Count call in order.
    node = Node("server", Codec(MESSAGES), TcpTransport(), {}, NodeConfig(max_concurrency=1))
    tally = [0]

    @node.handles(Small)
    async def on_small(msg: Small, ctx: Context) -> Small:
        if msg.kind != "rtt":
            tally[0] += 1
        return msg

    @node.handles(Count)
    async def on_count(msg: Count, ctx: Context) -> Count:
        done, tally[0] = tally[0], 0
        return Count(done)

    @node.accepts_stream(Begin)
    async def on_bulk(first: Begin, items: Any, ctx: Context) -> Count:
        total = 0
        async for item in items:
            total += len(item.payload)
        return Count(total)

    return node


async def echo(stream: anyio.abc.ByteStream) -> None:
    """Bare anyio echo, no mesh: the event loop's own share of the round trip."""
    async with stream:
        while True:
            try:
                await stream.send(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return


async def serve_mesh() -> None:
    node = mesh_server_node()
    async with node, await anyio.create_tcp_listener(local_host=HOST) as listener:
        address = await node.listen(Address(HOST, 0))
        echo_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        print(address.port, echo_port, flush=True)
        await listener.serve(echo)


async def mesh_bulk(node: Node, frames: int) -> float:
    start = time.perf_counter()
    async with node.stream_to("server", Begin(frames), timeout=600) as sink:
        for seq in range(frames):
            await sink.send(Chunk(seq, PAYLOAD))
    assert sink.result == Count(frames * len(PAYLOAD))
    return frames * len(PAYLOAD) / (time.perf_counter() - start)


async def mesh_small(node: Node, n: int) -> float:
    start = time.perf_counter()
    for seq in range(n):
        await node.cast("server", small(seq))
    assert await node.call("server", Count(0), timeout=600) == Count(n)
    return n / (time.perf_counter() - start)


async def mesh_rtt(node: Node, n: int) -> float:
    msg = msgspec.structs.replace(small(0), kind="rtt")
    start = time.perf_counter()
    for _ in range(n):
        await node.call("server", msg)
    return (time.perf_counter() - start) / n


async def anyio_rtt(port: int, n: int) -> float:
    frame = frame_of(small(0))
    async with await anyio.connect_tcp(HOST, port) as stream:
        start = time.perf_counter()
        for _ in range(n):
            await stream.send(frame)
            got = 0
            while got < len(frame):
                got += len(await stream.receive())
        return (time.perf_counter() - start) / n


async def mesh_round(ports: list[int], sizes: dict[str, int]) -> dict[str, float]:
    peers = {"server": Address(HOST, ports[0])}
    node = Node("client", Codec(MESSAGES), TcpTransport(), peers, NodeConfig(call_timeout=600))
    async with node:
        await mesh_rtt(node, 200)
        return {
            "bulk": await mesh_bulk(node, sizes["bulk"]),
            "small": await mesh_small(node, sizes["small"]),
            "rtt": await mesh_rtt(node, sizes["rtt"]),
            "anyio_rtt": await anyio_rtt(ports[1], sizes["rtt"]),
        }


def raw_round(ports: list[int], sizes: dict[str, int]) -> dict[str, float]:
    client = RawClient(ports[0])
    try:
        client.rtt(200)
        return {
            "bulk": client.bulk(sizes["bulk"]),
            "small": client.small(sizes["small"]),
            "rtt": client.rtt(sizes["rtt"]),
        }
    finally:
        client.sock.close()


# Driver ----------------------------------------------------------------------------------


def start_server(role: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "MALLOC_TOP_PAD_": MALLOC_PAD}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", role], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc, [int(port) for port in proc.stdout.readline().split()]


def measure(rounds: int, sizes: dict[str, int]) -> dict[str, dict[str, float]]:
    procs = {role: start_server(role) for role in ("raw", "trio", "uvloop")}
    runs: dict[str, list[dict[str, float]]] = {role: [] for role in procs}
    takers: dict[str, Callable[[list[int]], dict[str, float]]] = {
        "raw": lambda ports: raw_round(ports, sizes),
        "trio": lambda ports: run(mesh_round, ports, sizes, backend="trio"),
        "uvloop": lambda ports: run(mesh_round, ports, sizes, backend="uvloop"),
    }
    try:
        # Take the paths in turns, so that a slow spell of the host hits all of them alike.
        for _ in range(rounds):
            for role, (_, ports) in procs.items():
                runs[role].append(takers[role](ports))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait()
    return {
        role: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for role, results in runs.items()
    }


def report(medians: dict[str, dict[str, float]], quick: bool) -> dict[str, Any]:
    raw = medians["raw"]
    print(f"{'path':<22}{'bulk GB/s':>10}{'ratio':>7}{'small msg/s':>13}"
          f"{'rtt us':>9}{'ratio':>7}{'bare anyio rtt us':>19}")
    for role, m in medians.items():
        label = "raw blocking sockets" if role == "raw" else f"mesh on {role}"
        bare = f"{m['anyio_rtt'] * 1e6:>19.1f}" if "anyio_rtt" in m else f"{'-':>19}"
        print(f"{label:<22}{m['bulk'] / 1e9:>10.2f}{m['bulk'] / raw['bulk']:>7.2f}"
              f"{m['small']:>13,.0f}{m['rtt'] * 1e6:>9.1f}{m['rtt'] / raw['rtt']:>7.2f}{bare}")
    result: dict[str, Any] = {"bench": "wire", "quick": quick}
    for backend in ("trio", "uvloop"):
        m = medians[backend]
        result[f"bulk_ratio_{backend}"] = round(m["bulk"] / raw["bulk"], 3)
        result[f"rtt_ratio_{backend}"] = round(m["rtt"] / raw["rtt"], 3)
        result[f"{backend}_anyio_echo_rtt_us"] = round(m["anyio_rtt"] * 1e6, 1)
    for role, m in medians.items():
        result[f"{role}_gbytes_per_s"] = round(m["bulk"] / 1e9, 3)
        result[f"{role}_small_msgs_per_s"] = round(m["small"])
        result[f"{role}_rtt_us"] = round(m["rtt"] * 1e6, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (about 15 s)")
    parser.add_argument("--serve", choices=["raw", "trio", "uvloop"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "raw":
        serve_raw()
        return
    if args.serve:
        backend: Backend = "trio" if args.serve == "trio" else "uvloop"
        run(serve_mesh, backend=backend)
        return
    if os.environ.get("MALLOC_TOP_PAD_") != MALLOC_PAD:
        # glibc reads it at start-up only, so restart this process with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_TOP_PAD_": MALLOC_PAD})
    sizes = ({"bulk": 256, "small": 20_000, "rtt": 2_000} if args.quick
             else {"bulk": 1024, "small": 100_000, "rtt": 10_000})
    medians = measure(3 if args.quick else 5, sizes)
    print(json.dumps(report(medians, args.quick)))


if __name__ == "__main__":
    main()
