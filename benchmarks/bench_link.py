"""Link emulator benchmark: throughput and added latency of the proxy, and shaped-rate accuracy.

Three processes on 127.0.0.1, so the proxy's event loop shares nothing with the load: a
blocking sink/echo server, the `link` service (`serve_link`: proxy + control API) on
asyncio+uvloop with MALLOC_TOP_PAD_=64 MiB (docs/engineering-notes.md G3), and this process as
the blocking source. Every proxied number has a direct (no proxy) baseline from the same run.

    .venv/bin/python benchmarks/bench_link.py [--quick] [--backend uvloop|asyncio|trio]

Last, the data path's overlap (KV streamed while the prefill computes): a PrfaaS prefill worker
and a PD decode worker as `prfaas serve` processes with the link between them, set so that
moving a prompt's KV takes about as long as computing it (compute paced to the H200 profile,
emulated mode, so that the host's noise does not swing it). overlap_ratio = (prefill start to KV
fully received, streamed while computing) / (compute alone + the same KV through the link alone:
the run with every piece held until the compute is done), measured in the same run, median of
the runs; layer-wise streaming alone (one chunk) is shown beside it, then the timeline of one
more streamed run (`--overlap-only` runs this part alone).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mesh.cputime import cpu_seconds
from services.bench.sockets import recv_exact

ROOT = Path(__file__).resolve().parent.parent
SEND_BYTES = 1 << 20
SHAPED_RATES_BPS = (50e6, 200e6, 1e9)


def _sink_connection(conn: socket.socket) -> None:
    """'B' + 8-byte length: count that many bytes, then ack one byte. 'E': echo until EOF."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = recv_exact(conn, 1)
        if mode == b"B":
            remaining = int.from_bytes(recv_exact(conn, 8), "big")
            view = memoryview(bytearray(SEND_BYTES))
            while remaining > 0:
                received = conn.recv_into(view)
                if not received:
                    raise ConnectionError(f"bulk sender closed with {remaining} bytes to go")
                remaining -= received
            conn.sendall(b"A")
            return
        while data := conn.recv(65536):
            conn.sendall(data)


def run_sink() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_sink_connection, args=(conn,), daemon=True).start()


def run_proxy(upstream_port: int, backend: str) -> None:
    import anyio

    from netem.control import serve_link
    from netem.params import LinkParams
    from netem.proxy import Route

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(
                lambda task_status: serve_link(
                    [Route(0, upstream_port)], LinkParams(), 0, task_status=task_status
                )
            )
            ports = {"route": endpoints.routes[0][1], "control": endpoints.control[1]}
            print(json.dumps(ports), flush=True)

    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(main, backend="trio" if backend == "trio" else "asyncio", backend_options=options)


@contextmanager
def child(*args: str) -> Iterator[tuple[str, int]]:
    """This script in another role; yields the first line it prints, and its pid."""
    env = dict(os.environ, MALLOC_TOP_PAD_="67108864", PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip(), process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def bulk(port: int, nbytes: int) -> float:
    """Send `nbytes` to the sink; seconds from the first byte sent to the sink's ack."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"B" + nbytes.to_bytes(8, "big"))
        block = memoryview(bytes(SEND_BYTES))
        start = time.perf_counter()
        sent = 0
        while sent < nbytes:
            piece = min(SEND_BYTES, nbytes - sent)
            conn.sendall(block[:piece])
            sent += piece
        if recv_exact(conn, 1) != b"A":
            raise ConnectionError("sink did not ack")
        return time.perf_counter() - start


def ping_pong(port: int, rounds: int, size: int = 64) -> list[float]:
    """Round-trip times in microseconds of `size`-byte pings through the echo server."""
    payload = b"p" * size
    times = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"E")
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(payload)
            recv_exact(conn, size)
            times.append((time.perf_counter() - start) * 1e6)
    return times


def throughput(port: int, nbytes: int, runs: int) -> tuple[float, list[float]]:
    bulk(port, min(nbytes, 256 << 20))  # warm-up: page in buffers, settle the CPU
    rates = [nbytes / bulk(port, nbytes) / 1e9 for _ in range(runs)]
    return statistics.median(rates), rates


def set_link(control_port: int, **update: object) -> None:
    response = httpx.post(f"http://127.0.0.1:{control_port}/link", json=update, timeout=10)
    response.raise_for_status()


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


OVERLAP_TOPOLOGY = """
[[clusters]]
name = "prfaas"
kind = "prfaas"
[[clusters]]
name = "pd"
kind = "pd"
[[services]]
name = "prefill"
kind = "prefill"
cluster = "prfaas"
port = {p0}
options = {{ {model}, profile = "h200", chunk_tokens = {chunk}, connections = {lanes} }}
[[services]]
name = "decode"
kind = "decode"
cluster = "pd"
port = {p1}
options = {{ {model}, profile = "h20" }}
[[services]]
name = "link"
kind = "link"
port = {p2}
options = {{ control_port = {p3}, proxy_base_port = {p4}, chunk_bytes = 4096 }}
[[links]]
name = "link"
a = "prfaas"
b = "pd"
bandwidth_bps = 1e12
delay_s = 0.001
"""

# The tiny kimi-linear model: its fixed-size KDA state is 31.5 KB against 128 B of MLA latent
# per token (246 tokens' worth), the default model's 657 KB against 1 KB (657 tokens' worth),
# so at 8K tokens the state that can only leave at the end is 2.9 % of the KV here and 7.4 %
# with the default model (measured once at time scale 30: ratio 0.540 against a floor of
# 0.544; its real CPU compute, about 14 s per 8K prompt, makes a run take minutes).
# threads = 1: two intra-op threads on a shared 2-core host stall each other (measured: a
# paced 3.8 s prefill took 8.8 s), so the compute would overrun its pace.
OVERLAP_SIZE = "tiny"
OVERLAP_MODEL = (f'family = "kimi-linear", size = "{OVERLAP_SIZE}", checkpoint = "none", '
                 f"threads = 1")


@dataclass(frozen=True)
class OverlapSetup:
    """Modeled H200 prefill of 8192 tokens is 0.74 s; stretched 8x it is well above the real
    compute of the tiny model (about 1.5 s with one thread on a loaded host)."""

    length: int = 8192
    chunk: int = 128  # tokens per chunk: the KV left to send once the compute ends
    scale: float = 8.0
    runs: int = 3
    lanes: int = 2


@dataclass
class Timeline:
    """One streamed run: the prefill's KVFlow events and the link's egress byte count."""

    flows: list[Any] = field(default_factory=list)
    link: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes through)


async def _watch(node: Any, control: int, timeline: Timeline) -> None:
    """Collects the prefill's events and polls the link every 50 ms, until cancelled. All
    clocks are CLOCK_MONOTONIC here (asyncio and uvloop loops)."""
    import anyio

    from services.contract.events import KVFlow
    from services.contract.messages import Subscribe

    async def events() -> None:
        async with node.open_stream("prefill", Subscribe(maxlen=8192), timeout=3600) as items:
            async for item in items:
                if isinstance(item, KVFlow):
                    timeline.flows.append(item)

    async def link() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                reply = await client.get(f"http://127.0.0.1:{control}/link")
                egress = reply.json()["statistics"]["link"]["egress"]["bytes_out"]
                timeline.link.append((anyio.current_time(), int(egress)))
                await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(events)
        tg.start_soon(link)


async def _overlap_runs(topology_path: Path, control: int, setup: OverlapSetup,
                        paced_s: float) -> dict[str, Any]:
    import anyio

    from mesh.node import Node
    from mesh.topology import load_topology
    from mesh.transport import TcpTransport
    from mesh.wire import Codec
    from services.cli.send import drive_request
    from services.contract.messages import CODEC_MESSAGES
    from services.contract.sampling import Sampling

    topology = load_topology(topology_path, "")
    node = Node("bench", Codec(CODEC_MESSAGES), TcpTransport(), topology.address)
    salt = iter(range(1, 10_000))
    out: dict[str, Any] = {"overlapped": [], "held": [], "one_chunk": []}

    async def one(overlap: bool, chunk_tokens: int | None = None) -> Any:
        s = next(salt)
        prompt = [(i * 7 + s * 131) % 500 + 1 for i in range(setup.length)]
        result = await drive_request(node, prompt, prefill_worker="prefill", decode_worker="decode",
                                     request_id=f"overlap-{s}", sampling=Sampling(max_tokens=1),
                                     connections=setup.lanes, overlap=overlap,
                                     chunk_tokens=chunk_tokens, timeout=600)
        return result

    async with node:
        kv_bytes = (await one(True)).prefill.kv_bytes  # also the warm-up: first-use costs
        rate = kv_bytes * 8 / paced_s
        await anyio.to_thread.run_sync(lambda: set_link(control, bandwidth_bps=rate))
        out["calibration"] = (paced_s, kv_bytes, rate)
        for _ in range(setup.runs):
            out["overlapped"].append((await one(True)).prefill)
            out["held"].append((await one(False)).prefill)
            out["one_chunk"].append((await one(True, 0)).prefill)
        # One more streamed run, watched (the polling would disturb the measured ones).
        timeline = Timeline()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch, node, control, timeline)
            await anyio.sleep(0.3)  # the subscription is in place
            out["watched"] = await one(True)
            await anyio.sleep(0.1)  # the last link sample
            tg.cancel_scope.cancel()
        out["timeline"] = timeline
    return out


def _crossing(points: list[tuple[float, int]], level: float) -> float:
    return next((t for t, value in points if value >= level), float("nan"))


def print_timeline(out: dict[str, Any], setup: OverlapSetup) -> None:
    """When the watched run's KV was released to the lanes and through the link, and where
    the tail after the compute comes from."""
    from services.model.config import family_config, kv_layout

    watched, timeline = out["watched"], out["timeline"]
    done = watched.prefill
    flows = [f for f in timeline.flows if f.request_id == done.request_id]
    start = next(f.ts for f in flows if f.phase == "start")
    sent = [(f.ts - start, f.bytes_done) for f in flows if f.phase == "progress"]
    base = max((b for t, b in timeline.link if t <= start), default=timeline.link[0][1])
    through = [(t - start, b - base) for t, b in timeline.link]
    wire = through[-1][1]
    print(f"\ntimeline of one more streamed run (s from prefill start; compute ends at "
          f"{done.compute_s:.2f}, KV fully received at {done.total_s:.2f}):")
    print(f"{'share of the KV':<18}{'released to lanes':>19}{'through the link':>18}")
    for share in (0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        print(f"{share:>16.0%}  {_crossing(sent, share * done.kv_bytes):>17.2f}"
              f"{_crossing(through, share * wire):>18.2f}")
    print(f"first token at the client {watched.ttft_s - done.queue_s - done.total_s:.3f} s "
          f"after the KV was fully received (the decode worker's import and first reply)")
    layout = kv_layout(family_config("kimi-linear", OVERLAP_SIZE), "float32")
    state = layout.fixed / (layout.fixed + layout.per_token * setup.length)
    last = setup.chunk / setup.length * (1 - state)
    print(f"left for after the compute: the fixed-size states ({state:.1%} of the KV, final "
          f"only at the end) and the last chunk ({last:.1%}); with transfer = compute the "
          f"ratio cannot go below about (1 + {state + last:.3f}) / 2 = "
          f"{(1 + state + last) / 2:.3f}")


def measure_overlap(quick: bool) -> float:
    """Runs the prefill -> link -> decode path in processes; prints the table, returns the ratio."""
    import tempfile

    import anyio

    from mesh.ports import free_ports
    from services.cli.launch import launch
    from services.paper.hardware import CostModel

    setup = OverlapSetup(runs=1, scale=6.0) if quick else OverlapSetup()
    paced_s = CostModel.load("h200").prefill_time(setup.length) * setup.scale
    ports = free_ports(5)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "topology.toml"
        path.write_text(OVERLAP_TOPOLOGY.format(p0=ports[0], p1=ports[1], p2=ports[2],
                                                p3=ports[3], p4=ports[4], chunk=setup.chunk,
                                                lanes=setup.lanes, model=OVERLAP_MODEL))
        paced = ["--mode", "emulated", "--time-scale", str(setup.scale)]
        with launch(path, ["link", "prefill", "decode"], extra_args=paced, log_dir=Path(tmp)):
            out = anyio.run(_overlap_runs, path, ports[3], setup, paced_s)
    return print_overlap(out, setup)


def print_overlap(out: dict[str, Any], setup: OverlapSetup) -> float:
    compute, kv_bytes, rate = out["calibration"]
    held = out["held"]
    serial = [p.compute_s + p.transfer_s for p in held]
    print(f"\noverlap: kimi-linear {OVERLAP_SIZE}, compute paced to H200 x {setup.scale} "
          f"(emulated mode: steady on a shared host), {setup.length}-token prompts, chunks of "
          f"{setup.chunk} "
          f"tokens, {kv_bytes / 1e6:.2f} MB of KV each over {setup.lanes} lanes;\nlink set to "
          f"{rate / 1e6:.2f} Mbit/s so that transfer ~ paced compute ({compute:.2f} s); median "
          f"of {setup.runs}")
    alone = (statistics.median(p.compute_s for p in held),
             statistics.median(p.transfer_s for p in held))
    print(f"serial baseline (the held run): compute alone {alone[0]:.2f} s, then the same KV "
          f"through the link alone {alone[1]:.2f} s")
    print("ratio = total / (compute alone + transfer alone), each run against the held run "
          "next to it")
    print(f"{'mode':<36}{'compute s':>10}{'after s':>9}{'total s':>9}{'ratio':>7}")
    ratio = 0.0
    for name, key in (("held until computed (baseline)", "held"),
                      ("streamed, chunked (layer x chunk)", "overlapped"),
                      ("streamed, layer-wise only", "one_chunk")):
        rows = out[key]
        ratios = [p.total_s / s for p, s in zip(rows, serial, strict=True)]
        print(f"{name:<36}{statistics.median(p.compute_s for p in rows):>10.2f}"
              f"{statistics.median(p.transfer_s for p in rows):>9.2f}"
              f"{statistics.median(p.total_s for p in rows):>9.2f}"
              f"{statistics.median(ratios):>7.3f}   runs: "
              + " ".join(f"{r:.3f}" for r in ratios))
        ratio = statistics.median(ratios) if key == "overlapped" else ratio
    print_timeline(out, setup)
    return round(ratio, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short run (its overlap part alone: about 40 s)")
    parser.add_argument("--backend", default="uvloop", choices=["uvloop", "asyncio", "trio"])
    parser.add_argument("--overlap-only", action="store_true",
                        help="only the data path's overlap measurement")
    parser.add_argument("--role", choices=["sink", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sink":
        return run_sink()
    if args.role == "proxy":
        return run_proxy(args.upstream, args.backend)
    if args.overlap_only:
        print(json.dumps({"bench": "link", "overlap_ratio": measure_overlap(args.quick)}))
        return None

    bulk_bytes = (512 << 20) if args.quick else (2 << 30)
    runs, rounds, shaped_s = (1, 2000, 1.5) if args.quick else (3, 10000, 4.0)
    with child("--role", "sink") as (sink_line, _):
        sink_port = int(sink_line)
        proxy_args = ("--role", "proxy", "--upstream", str(sink_port), "--backend", args.backend)
        with child(*proxy_args) as (proxy_line, proxy_pid):
            ports = json.loads(proxy_line)
            direct_gbs, direct_runs = throughput(sink_port, bulk_bytes, runs)
            cpu_before = cpu_seconds(proxy_pid)
            proxy_gbs, proxy_runs = throughput(ports["route"], bulk_bytes, runs)
            moved_gb = (runs * bulk_bytes + min(bulk_bytes, 256 << 20)) / 1e9
            proxy_cpu_s_per_gb = (cpu_seconds(proxy_pid) - cpu_before) / moved_gb
            direct_rtt = ping_pong(sink_port, rounds)
            proxy_rtt = ping_pong(ports["route"], rounds)
            shaped = []
            for rate in SHAPED_RATES_BPS:
                set_link(ports["control"], bandwidth_bps=rate)
                nbytes = int(rate / 8 * shaped_s)
                measured = nbytes * 8 / bulk(ports["route"], nbytes)
                shaped.append((rate, measured, nbytes))
            set_link(ports["control"], bandwidth_bps=None)
            link = httpx.get(f"http://127.0.0.1:{ports['control']}/link", timeout=10).json()

    direct_p50, proxy_p50 = statistics.median(direct_rtt), statistics.median(proxy_rtt)
    print(
        f"link bench: proxy on {args.backend}, {bulk_bytes >> 20} MiB per bulk run, {rounds} pings"
    )
    print(f"{'path':<22}{'GB/s (median)':>14}{'runs':>22}{'rtt p50 us':>12}{'p99 us':>10}")
    for name, gbs, rates, rtt in (
        ("direct (baseline)", direct_gbs, direct_runs, direct_rtt),
        ("proxy, unshaped", proxy_gbs, proxy_runs, proxy_rtt),
    ):
        runs_text = " ".join(f"{rate:.2f}" for rate in rates)
        print(
            f"{name:<22}{gbs:>14.2f}{runs_text:>22}{statistics.median(rtt):>12.1f}"
            f"{quantile(rtt, 0.99):>10.1f}"
        )
    print(
        f"{'proxy / direct':<22}{proxy_gbs / direct_gbs:>14.2f}{'':>22}"
        f"{proxy_p50 / direct_p50:>12.2f}   added p50 {proxy_p50 - direct_p50:.1f} us"
    )
    print(
        f"\n{'shaped rate':<14}{'set Mbit/s':>12}{'measured':>12}{'rel error':>11}{'MB sent':>10}"
    )
    errors = []
    for rate, measured, nbytes in shaped:
        errors.append(abs(measured - rate) / rate)
        print(
            f"{rate / 1e6:>10.0f} Mb{rate / 1e6:>14.1f}{measured / 1e6:>12.1f}"
            f"{(measured - rate) / rate:>+11.2%}{nbytes / 1e6:>10.1f}"
        )
    egress = link["statistics"]["link"]["egress"]
    print(
        f"\nproxy egress bytes_out {egress['bytes_out']}, connections "
        f"{link['statistics']['connections_total']}, errors "
        f"{link['statistics']['connection_errors']}"
    )
    print(
        f"proxy CPU {proxy_cpu_s_per_gb:.2f} s per GB forwarded unshaped (user + system; "
        f"{1 / proxy_cpu_s_per_gb:.1f} GB/s if it had a core to itself)"
    )
    overlap = measure_overlap(args.quick)
    result = {
        "bench": "link",
        "unshaped_gbytes_per_s": round(proxy_gbs, 3),
        "added_latency_us_p50": round(proxy_p50 - direct_p50, 1),
        "shaped_rate_max_rel_error": round(max(errors), 4),
        "overlap_ratio": overlap,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
