"""Wire benchmark: the mesh over loopback TCP against raw blocking sockets, in the same run.

Three servers run as subprocesses: a raw blocking-socket server, a mesh node on trio, a mesh
node on asyncio+uvloop. By default they are pinned to one CPU and the client to another, so
sender and receiver each get a core, as in a deployment and as docs/engineering-notes.md measured
(raw round
trip about 96 us). Left to itself the kernel often puts both ends of a round trip on one core;
the round trip then costs no cross-CPU wake-ups (raw about 22 us) and its time is simply the
CPU work of both sides: `--pin same` measures that case on purpose.
The client (this process) measures, for each:
  bulk   1 MiB frames: `node.stream_to` items (payload a memoryview field, as KV pieces carry
         theirs: decoded without a copy) against the byte-moving limit of a plain socket
         (raw: the same frame bytes, encoded once, `sendall` on one side and `recv_into` a
         preallocated buffer 64 KiB at a time on the other, nothing decoded; RAW_READ says
         why); GB/s. Beside it: the same with reads of up to 1 MiB (raw_read_1m), and the raw
         side's framed msgspec stream (encode and decode every frame) as raw_msgspec
  small  ~200-byte messages: raw, one `sendall` each; mesh, `node.cast` (batched by the outbox)
  rtt    ~200-byte request/reply: raw send+recv vs `node.call`; microseconds per round trip,
         wall time and CPU time (client process + server process, from /proc/<pid>/schedstat)
  bare rtt: the same bytes echoed, no mesh, in the mesh server's process, through anyio's
         socket streams and through the mesh's own (mesh.tcp): the event loop's share of the
         mesh round trip, and the floor under it
Apart from the bulk limit, both sides encode and decode every message with msgspec (the raw
side with a plain length prefix and the same message Structs). Each figure is the median of
several repetitions taken in turns, since the 2-vCPU host has slow windows
(docs/engineering-notes.md G12): bulk in 15 short rounds of 512 MiB a path (one transfer
swung from 2 to 6.7 GB/s on an idle host), the rest in 5; `bulk_ratio_<backend>_spread` is
the lowest and highest ratio of one round, the path and raw measured back to back.
The two sides of a round trip run one after the other, so its wall time is about the CPU
time of both plus wake-ups;
CPU time is less disturbed by other load on the host than wall time. Every process runs with
glibc's allocator settings of mesh/allocator.py: without the 64 MiB top pad glibc trims and
regrows the heap per received chunk (docs/engineering-notes.md G3). Every warm-up and round
has a deadline of seconds (WARM_UP_SECONDS, ROUND_SECONDS), and every mesh call and cast one
of its own (OPERATION_SECONDS): one that passes it stops the run with an error naming the
round (RoundOverdue), instead of waiting out a hang. The last line printed is one JSON object.

    .venv/bin/python benchmarks/bench_wire.py [--quick] [--pin cross|same|none]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.abc
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mesh.allocator import allocator_env, has_allocator_env
from mesh.errors import DeadlineExceeded
from mesh.node import Node, NodeConfig
from mesh.run import Backend, run
from mesh.server import Context
from mesh.transport import Address, TcpTransport
from mesh.wire import Codec

PAYLOAD = memoryview(b"\xa5" * (1 << 20))
HOST = "127.0.0.1"
# Deadlines in seconds: a warm-up, one round of each phase, and each mesh call or cast in a
# round (a hung one is caught long before its round's deadline). On the 2-vCPU host shared
# with other busy processes (load average 7-11), a bulk round took at most 1.5 s (a warm-up
# included) and a round of the rest 58 s, about 20 s typically; a round trip is under 1 ms.
WARM_UP_SECONDS = 10.0
OPERATION_SECONDS = 10.0
ROUND_SECONDS = {"bulk": 30.0, "rest": 180.0}

T = TypeVar("T")


class RoundOverdue(Exception):
    """A warm-up or round passed its deadline; the message names it."""


def overdue(what: str, seconds: float, cause: BaseException | None) -> RoundOverdue:
    because = "" if cause is None else f" ({type(cause).__name__}: {cause})"
    return RoundOverdue(f"{what} passed its deadline of {seconds:g} s{because}")


class Chunk(msgspec.Struct, frozen=True, tag=True):
    seq: int
    # As KVChunk.data: decoded as a view of the received frame, without copying the payload.
    payload: memoryview


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


def process_cpu(pid: int) -> float:
    """Seconds of CPU used so far by process `pid` (Linux schedstat; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/schedstat") as stats:
            return int(stats.read().split()[0]) / 1e9
    except (OSError, ValueError):
        return math.nan


class RoundTripClock:
    """Wall time, this process's CPU and the server process's CPU since creation."""

    def __init__(self, server: int) -> None:
        self.server = server
        self.wall = time.perf_counter()
        self.client_cpu = time.process_time()
        self.server_cpu = process_cpu(server)

    def per(self, n: int) -> dict[str, float]:
        """Each figure divided by `n` round trips (seconds)."""
        return {
            "rtt": (time.perf_counter() - self.wall) / n,
            "rtt_cpu_client": (time.process_time() - self.client_cpu) / n,
            "rtt_cpu_server": (process_cpu(self.server) - self.server_cpu) / n,
        }


# Raw blocking-socket side ----------------------------------------------------------------


class Watchdog:
    """The deadline of a round on blocking sockets: past it, a timer thread shuts the
    watched sockets down, so that the call blocked on one returns, and the round then fails
    with RoundOverdue naming it. Nothing is added to the sockets' own calls (a socket timeout
    would poll before every send and receive, and the raw figures are the baseline)."""

    def __init__(self, what: str, seconds: float) -> None:
        self.what = what
        self.seconds = seconds
        self._sockets: list[socket.socket] = []
        self._fired = threading.Event()
        self._timer = threading.Timer(seconds, self._expire)

    def watch(self, sock: socket.socket) -> socket.socket:
        self._sockets.append(sock)
        return sock

    def _expire(self) -> None:
        self._fired.set()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                # Closed already (ENOTCONN, EBADF): nothing of it is left to unblock.
                continue

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._timer.cancel()
        if self._fired.is_set():
            raise overdue(self.what, self.seconds, exc) from exc


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
            # A Chunk's payload is a view of buf, which cannot be resized while it lives.
            del msg
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
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the raw server closed the connection")
            self.buf += data

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

    def rtt(self, n: int, server: int) -> dict[str, float]:
        msg = msgspec.structs.replace(small(0), kind="rtt")
        clock = RoundTripClock(server)
        for _ in range(n):
            self.send(msg)
            self.read()
        return clock.per(n)


# The raw receiver's read size. Reading loopback TCP 64 KiB at a time is what a plain socket
# does best here: a sweep of 16 KiB to 4 MiB, blocking sender and receiver each on a CPU of the
# 2-vCPU host, gave 4.9 GB/s at 64 KiB against 4.0 at 1 MiB (the sender is the bound, and
# cheaper per byte when the reader takes each segment as it comes; docs/engineering-notes.md
# 3a). The 1 MiB read, this bench's limit before, is reported beside it (raw_read_1m).
RAW_READ = 64 * 1024


def bytes_serve(conn: socket.socket) -> None:
    """The byte-moving limit: per transfer an 8-byte total and an 8-byte read size, then that
    many bytes read with recv_into a preallocated buffer (never looked at), then an 8-byte
    acknowledgement."""
    buf = memoryview(bytearray(1 << 20))
    while head := conn.recv(16, socket.MSG_WAITALL):
        left, step = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:], "big")
        while left:
            got = conn.recv_into(buf, min(left, step, len(buf)))
            if not got:
                return
            left -= got
        conn.sendall(head[:8])


def bytes_bulk(port: int, frames: int, dog: Watchdog, read: int = RAW_READ) -> float:
    """GB/s of `frames` Chunk frames, encoded once and sent as they are, the receiver reading
    at most `read` bytes a time (see bytes_serve)."""
    data = frame_of(Chunk(0, PAYLOAD))
    total = frames * len(data)
    with dog.watch(socket.create_connection((HOST, port))) as sock:
        start = time.perf_counter()
        sock.sendall(total.to_bytes(8, "big") + read.to_bytes(8, "big"))
        for _ in range(frames):
            sock.sendall(data)
        assert int.from_bytes(sock.recv(8, socket.MSG_WAITALL), "big") == total
        return frames * len(PAYLOAD) / (time.perf_counter() - start)


def serve_raw() -> None:
    """Two listeners on two threads: framed msgspec messages, and the bulk byte limit."""
    import threading

    def loop(listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                serve(conn)

    with socket.create_server((HOST, 0)) as framed, socket.create_server((HOST, 0)) as plain:
        print(framed.getsockname()[1], plain.getsockname()[1], flush=True)
        threading.Thread(target=loop, args=(plain, bytes_serve), daemon=True).start()
        loop(framed, raw_serve)


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
    """Bare echo, no mesh: the event loop's own share of the round trip."""
    async with stream:
        while True:
            try:
                await stream.send(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return


async def serve_mesh() -> None:
    node = mesh_server_node()
    fast = await TcpTransport().listen(Address(HOST, 0))
    async with node, fast.listener, await anyio.create_tcp_listener(local_host=HOST) as listener:
        address = await node.listen(Address(HOST, 0))
        echo_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        print(address.port, echo_port, fast.address.port, flush=True)
        async with anyio.create_task_group() as group:
            group.start_soon(fast.listener.serve, echo)
            await listener.serve(echo)


async def within(seconds: float, what: str, work: Callable[[], Awaitable[T]]) -> T:
    """work() under a deadline of `seconds`; RoundOverdue naming `what` once past it (the
    mesh's own deadlines, which the node's calls and streams carry, included)."""
    try:
        with anyio.fail_after(seconds):
            return await work()
    except DeadlineExceeded as exc:
        raise RoundOverdue(f"{what}: an operation passed its deadline ({exc})") from exc
    except TimeoutError as exc:
        raise overdue(what, seconds, exc) from exc


async def mesh_bulk(node: Node, frames: int, seconds: float) -> float:
    start = time.perf_counter()
    async with node.stream_to("server", Begin(frames), timeout=seconds) as sink:
        for seq in range(frames):
            await sink.send(Chunk(seq, PAYLOAD))
    assert sink.result == Count(frames * len(PAYLOAD))
    return frames * len(PAYLOAD) / (time.perf_counter() - start)


async def mesh_small(node: Node, n: int) -> float:
    start = time.perf_counter()
    for seq in range(n):
        await node.cast("server", small(seq))
    assert await node.call("server", Count(0)) == Count(n)
    return n / (time.perf_counter() - start)


async def mesh_rtt(node: Node, n: int, server: int) -> dict[str, float]:
    msg = msgspec.structs.replace(small(0), kind="rtt")
    clock = RoundTripClock(server)
    for _ in range(n):
        await node.call("server", msg)
    return clock.per(n)


async def echo_rtt(stream: anyio.abc.ByteStream, n: int) -> float:
    frame = frame_of(small(0))
    async with stream:
        start = time.perf_counter()
        for _ in range(n):
            await stream.send(frame)
            got = 0
            while got < len(frame):
                got += len(await stream.receive())
        return (time.perf_counter() - start) / n


def client_node(ports: list[int]) -> Node:
    """The client; each of its calls and casts has a deadline of OPERATION_SECONDS."""
    peers = {"server": Address(HOST, ports[0])}
    config = NodeConfig(call_timeout=OPERATION_SECONDS)
    return Node("client", Codec(MESSAGES), TcpTransport(), peers, config)


async def mesh_bulk_round(ports: list[int], frames: int, name: str) -> dict[str, float]:
    seconds = ROUND_SECONDS["bulk"]
    async with client_node(ports) as node:
        await within(WARM_UP_SECONDS, f"the warm-up of {name}",
                     lambda: mesh_bulk(node, 8, WARM_UP_SECONDS))
        return {"bulk": await within(seconds, name, lambda: mesh_bulk(node, frames, seconds))}


async def mesh_round(server: int, ports: list[int], sizes: dict[str, int],
                     name: str) -> dict[str, float]:
    seconds = ROUND_SECONDS["rest"]
    async with client_node(ports) as node:
        await within(WARM_UP_SECONDS, f"the warm-up of {name}",
                     lambda: mesh_rtt(node, 200, server))
        return await within(seconds, name, lambda: mesh_rest(node, server, ports, sizes))


async def mesh_rest(node: Node, server: int, ports: list[int],
                    sizes: dict[str, int]) -> dict[str, float]:
    return {
        "small": await mesh_small(node, sizes["small"]),
        **await mesh_rtt(node, sizes["rtt"], server),
        "anyio_rtt": await echo_rtt(await anyio.connect_tcp(HOST, ports[1]), sizes["rtt"]),
        "fast_rtt": await echo_rtt(
            await TcpTransport().connect(Address(HOST, ports[2])), sizes["rtt"]
        ),
    }


def raw_bulk_round(ports: list[int], frames: int, name: str) -> dict[str, float]:
    with Watchdog(name, ROUND_SECONDS["bulk"]) as dog:
        client = RawClient(ports[0])
        dog.watch(client.sock)
        try:
            return {
                "bulk": bytes_bulk(ports[1], frames, dog),
                "bulk_read_1m": bytes_bulk(ports[1], frames, dog, read=1 << 20),
                "bulk_msgspec": client.bulk(frames),
            }
        finally:
            client.sock.close()


def raw_round(server: int, ports: list[int], sizes: dict[str, int],
              name: str) -> dict[str, float]:
    client = RawClient(ports[0])
    try:
        with Watchdog(f"the warm-up of {name}", WARM_UP_SECONDS) as dog:
            dog.watch(client.sock)
            client.rtt(200, server)
        with Watchdog(name, ROUND_SECONDS["rest"]) as dog:
            dog.watch(client.sock)
            return {
                "small": client.small(sizes["small"]),
                **client.rtt(sizes["rtt"], server),
            }
    finally:
        client.sock.close()


# Driver ----------------------------------------------------------------------------------


def pin(mode: str, servers: list[int]) -> str:
    """Puts this process and the servers on CPUs; a line saying where (or why not)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode == "none" or len(cpus) < 2:
        return "not pinned: the kernel places the processes"
    client_cpu, server_cpu = cpus[0], cpus[1] if mode == "cross" else cpus[0]
    os.sched_setaffinity(0, {client_cpu})
    for pid in servers:
        os.sched_setaffinity(pid, {server_cpu})
    return f"pinned: client on CPU {client_cpu}, servers on CPU {server_cpu}"


def start_server(role: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = allocator_env(os.environ)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", role], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc, [int(port) for port in proc.stdout.readline().split()]


Runs = dict[str, list[dict[str, float]]]


# A round of one path: (server pid, server ports, the round's name) -> its figures.
Taker = Callable[[int, list[int], str], dict[str, float]]


def measure(rounds: dict[str, int], sizes: dict[str, int], placement: str) -> Runs:
    """Each path's figures, one dict a round: first `rounds["bulk"]` short rounds of bulk
    alone, then `rounds["rest"]` of the other figures, the paths taking turns in every round."""
    procs = {role: start_server(role) for role in ("raw", "trio", "uvloop")}
    print(pin(placement, [proc.pid for proc, _ in procs.values()]))
    frames = sizes["bulk"]
    phases: list[tuple[str, dict[str, Taker]]] = [
        ("bulk", {
            "raw": lambda pid, ports, name: raw_bulk_round(ports, frames, name),
            "trio": lambda pid, ports, name: run(mesh_bulk_round, ports, frames, name,
                                                 backend="trio"),
            "uvloop": lambda pid, ports, name: run(mesh_bulk_round, ports, frames, name,
                                                   backend="uvloop"),
        }),
        ("rest", {
            "raw": lambda pid, ports, name: raw_round(pid, ports, sizes, name),
            "trio": lambda pid, ports, name: run(mesh_round, pid, ports, sizes, name,
                                                 backend="trio"),
            "uvloop": lambda pid, ports, name: run(mesh_round, pid, ports, sizes, name,
                                                   backend="uvloop"),
        }),
    ]
    runs: Runs = {role: [] for role in procs}
    try:
        for phase, takers in phases:
            count = rounds[phase]
            # Take the paths in turns, so that a slow spell of the host hits all of them alike.
            for i in range(count):
                for role, (proc, ports) in procs.items():
                    name = f"{label(role)}: {phase} round {i + 1} of {count}"
                    start = time.perf_counter()
                    figures = takers[role](proc.pid, ports, name)
                    figures[f"{phase}_round_s"] = time.perf_counter() - start
                    if i < len(runs[role]):
                        runs[role][i].update(figures)
                    else:
                        runs[role].append(figures)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait()
    return runs


def medians(runs: Runs) -> dict[str, dict[str, float]]:
    """Each figure's median over the rounds that measured it."""
    return {
        role: {key: statistics.median(r[key] for r in results if key in r)
               for key in results[0]}
        for role, results in runs.items()
    }


def bulk_ratio_spread(runs: Runs, backend: str) -> list[float]:
    """The lowest and highest bulk ratio of one round (the path and raw a second apart):
    how far the host's load moved the ratio."""
    ratios = [m["bulk"] / r["bulk"] for m, r in zip(runs[backend], runs["raw"], strict=False)
              if "bulk" in m and "bulk" in r]
    return [round(min(ratios), 3), round(max(ratios), 3)]


def rtt_cpu(m: dict[str, float]) -> float:
    return m["rtt_cpu_client"] + m["rtt_cpu_server"]


def label(role: str) -> str:
    return "raw blocking sockets" if role == "raw" else f"mesh on {role}"


def us(m: dict[str, float], key: str) -> str:
    return f"{m[key] * 1e6:.1f}" if key in m else "-"


def slowest_rounds(runs: Runs) -> dict[str, float]:
    """Each phase's longest round (its warm-up included), over every path: seconds."""
    return {phase: round(max(r[key] for results in runs.values() for r in results
                             if (key := f"{phase}_round_s") in r), 2)
            for phase in ROUND_SECONDS}


def report(runs: Runs, quick: bool) -> dict[str, Any]:
    typical = medians(runs)
    raw = typical["raw"]
    print("bulk ratios against the raw byte-moving limit (recv_into, nothing decoded);"
          " spread: the lowest and highest of one round")
    print(f"{'path':<22}{'bulk GB/s':>10}{'ratio':>7}{'spread':>14}{'small msg/s':>13}")
    for role, m in typical.items():
        low, high = bulk_ratio_spread(runs, role)
        spread = "-" if role == "raw" else f"{low:.2f}-{high:.2f}"
        print(f"{label(role):<22}{m['bulk'] / 1e9:>10.2f}{m['bulk'] / raw['bulk']:>7.2f}"
              f"{spread:>14}{m['small']:>13,.0f}")
    for name, key in (("raw, 1 MiB reads", "bulk_read_1m"), ("raw, msgspec frames",
                                                             "bulk_msgspec")):
        print(f"{name:<22}{raw[key] / 1e9:>10.2f}{raw[key] / raw['bulk']:>7.2f}")
    print(f"\n{'path':<22}{'rtt us':>8}{'ratio':>7}{'cpu us (cli+srv)':>20}{'ratio':>7}"
          f"{'bare anyio echo':>17}{'bare mesh.tcp echo':>20}")
    for role, m in typical.items():
        cpu = f"{rtt_cpu(m) * 1e6:.1f} ({us(m, 'rtt_cpu_client')}+{us(m, 'rtt_cpu_server')})"
        print(f"{label(role):<22}{m['rtt'] * 1e6:>8.1f}{m['rtt'] / raw['rtt']:>7.2f}{cpu:>20}"
              f"{rtt_cpu(m) / rtt_cpu(raw):>7.2f}{us(m, 'anyio_rtt'):>17}{us(m, 'fast_rtt'):>20}")
    slowest = slowest_rounds(runs)
    print("\nslowest round, of its deadline: " + ", ".join(
        f"{phase} {slowest[phase]:.1f} s of {ROUND_SECONDS[phase]:g} s" for phase in slowest))
    # bulk ratios are against the byte-moving limit (raw recv_into, nothing decoded).
    result: dict[str, Any] = {"bench": "wire", "quick": quick, "bulk_baseline": "recv_into"}
    result["slowest_round_s"] = slowest
    result["round_deadline_s"] = ROUND_SECONDS
    result["raw_read_bytes"] = RAW_READ
    result["raw_read_1m_gbytes_per_s"] = round(raw["bulk_read_1m"] / 1e9, 3)
    result["bulk_ratio_raw_read_1m"] = round(raw["bulk_read_1m"] / raw["bulk"], 3)
    result["raw_msgspec_gbytes_per_s"] = round(raw["bulk_msgspec"] / 1e9, 3)
    result["bulk_ratio_raw_msgspec"] = round(raw["bulk_msgspec"] / raw["bulk"], 3)
    for backend in ("trio", "uvloop"):
        m = typical[backend]
        result[f"bulk_ratio_{backend}"] = round(m["bulk"] / raw["bulk"], 3)
        result[f"bulk_ratio_{backend}_spread"] = bulk_ratio_spread(runs, backend)
        result[f"rtt_ratio_{backend}"] = round(m["rtt"] / raw["rtt"], 3)
        result[f"rtt_cpu_ratio_{backend}"] = round(rtt_cpu(m) / rtt_cpu(raw), 3)
        result[f"{backend}_anyio_echo_rtt_us"] = round(m["anyio_rtt"] * 1e6, 1)
        result[f"{backend}_fast_echo_rtt_us"] = round(m["fast_rtt"] * 1e6, 1)
    for role, m in typical.items():
        result[f"{role}_gbytes_per_s"] = round(m["bulk"] / 1e9, 3)
        result[f"{role}_small_msgs_per_s"] = round(m["small"])
        result[f"{role}_rtt_us"] = round(m["rtt"] * 1e6, 1)
        result[f"{role}_rtt_cpu_client_us"] = round(m["rtt_cpu_client"] * 1e6, 1)
        result[f"{role}_rtt_cpu_server_us"] = round(m["rtt_cpu_server"] * 1e6, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (about 15 s)")
    parser.add_argument(
        "--pin", choices=["cross", "same", "none"], default="cross",
        help="cross (default): client and servers on two different CPUs, each side its own "
        "core as in a deployment; same: all on one CPU; none: wherever the kernel puts them",
    )
    parser.add_argument("--serve", choices=["raw", "trio", "uvloop"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "raw":
        serve_raw()
        return
    if args.serve:
        backend: Backend = "trio" if args.serve == "trio" else "uvloop"
        run(serve_mesh, backend=backend)
        return
    if not has_allocator_env(os.environ):
        # glibc reads them at start-up only, so restart this process with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], allocator_env(os.environ))
    sizes = ({"bulk": 256, "small": 20_000, "rtt": 2_000} if args.quick
             else {"bulk": 512, "small": 100_000, "rtt": 10_000})
    rounds = {"bulk": 5, "rest": 3} if args.quick else {"bulk": 15, "rest": 5}
    try:
        runs = measure(rounds, sizes, args.pin)
    except RoundOverdue as exc:
        sys.exit(f"bench_wire: {exc}")
    print(json.dumps({**report(runs, args.quick), "pin": args.pin}))


if __name__ == "__main__":
    main()
