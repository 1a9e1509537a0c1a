"""The kernel as an anchor for the emulator: one KV transfer volume through the project's link
emulator and over a veth shaped by the kernel's tbf, at the same rate.

For each rate, one series of KV transfers (sizes of the default model's KV cache, float32, for
prompt lengths drawn from the paper's workload, seeded; back to back, enough for `--seconds`
at the rate) is sent twice by the same sender process to the same sink process, which acks
each transfer once it has all of it:

- emulator: sender, sink and the `link` service's TCP proxy (netem, asyncio+uvloop, shaped
  at the rate) on 127.0.0.1; no qdisc;
- kernel: sender and sink in two network namespaces made here, joined by a veth whose two
  ends tbf shapes at the rate (netem/netns.py: 9000-byte MTU, 198.18.0.0/15 addresses); no
  emulator. The namespaces are removed at the end, whatever ends the run.

Per path: the delivered rate (payload bytes over the time from the first byte sent to the
last ack) and its ratio to the set rate, each transfer's time (send start to ack; median,
P90), and the bandwidth the router's estimator (services/router/link_meter.py) computes from
the sender's own counters: a `SendMeter` (services/worker/send_meter.py) counts the bytes
acked and the time a transfer was waiting for its ack (back to back, the sender is held all
the time: the link is saturated), read every `POLL_S` as the router reads a worker's status.
The estimator is a pure function of (time, readings), so the readings are fed to it after the
run, as they would have been live.

    sudo .venv/bin/python benchmarks/bench_kernel_link.py [--rates 1e9,10e9] [--seconds 6]
        [--window 3]

The last line is one JSON object. For each rate, tagged by it in Gbit/s ("1g", "10g";
in Mbit/s below one: "200m"): `{tag}_set_bps`, and per path
(`emulator`, `kernel`): `{path}_{tag}_rate_ratio` (delivered / set),
`{path}_{tag}_delivered_bps`, `{path}_{tag}_transfer_p50_ms`, `{path}_{tag}_transfer_p90_ms`,
`{path}_{tag}_estimate_ratio` (the estimator's bandwidth / delivered), `{path}_{tag}_held` (the
share of the run the sender was held); `{tag}_volume_bytes`, `{tag}_transfers`; and `cpu`,
`load_average`, `date`, `estimator_window_s`.
Not root, or namespaces refused: a message on stderr and exit code 3, nothing made.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any

from netem.netns import NetLab, NetnsError, Veth, remove_stale, require_netns
from services.bench.host import cpu_name, load_average
from services.bench.sockets import recv_exact
from services.bench.stats import percentile
from services.cli.multihost import EXIT_NO_NETNS
from services.model.config import family_config, kv_bytes
from services.paper.workload import TruncatedLogNormal
from services.router.link_meter import BandwidthEstimator, EstimatorConfig
from services.worker.send_meter import SendMeter

ROOT = Path(__file__).resolve().parent.parent
KV_FAMILY = "kimi-linear"
PIECE_BYTES = 1 << 20
# The router polls each worker's status about this often.
POLL_S = 0.25
SENDER_HOST, SINK_HOST = "198.18.5.1", "198.18.5.2"
SEED = 0
# 10 Gbit/s is beyond what the emulator's one event loop carries on a 2-core host
# (docs/deploy.md, "The kernel as an anchor for the emulator"): the default's second rate is
# the nearest it holds there; `--rates 1e9,10e9` asks for the paper's.
DEFAULT_RATES = "1e9,2e9"
CHILD_TIMEOUT_S = 120.0


def kv_transfer_sizes(volume_bytes: int, seed: int = SEED, size: str = "default") -> list[int]:
    """KV cache sizes of prompts drawn from the paper's workload, until they add up to at
    least `volume_bytes`."""
    cfg, lengths, rng = family_config(KV_FAMILY, size), TruncatedLogNormal.paper(), Random(seed)
    sizes, total = [], 0
    while total < volume_bytes:
        sizes.append(kv_bytes(cfg, lengths.sample(rng)))
        total += sizes[-1]
    return sizes


def run_sink(host: str) -> None:
    """One connection: 8-byte length, that many bytes, ack one byte; length 0 ends it."""
    with socket.create_server((host, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    with conn:
        view = memoryview(bytearray(PIECE_BYTES))
        while remaining := int.from_bytes(recv_exact(conn, 8), "big"):
            while remaining > 0:
                received = conn.recv_into(view[:min(PIECE_BYTES, remaining)])
                if not received:
                    raise ConnectionError(f"sender closed with {remaining} bytes to go")
                remaining -= received
            conn.sendall(b"A")


def run_proxy(upstream_port: int, rate_bps: float) -> None:
    """The `link` service shaped at `rate_bps`, forwarding to the sink; prints its port."""
    import anyio

    from netem.control import serve_link
    from netem.params import LinkParams
    from netem.proxy import Route

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(lambda task_status: serve_link(
                [Route(0, upstream_port)], LinkParams(bandwidth_bps=rate_bps), 0,
                task_status=task_status))
            print(endpoints.routes[0][1], flush=True)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})


class MeterPoller:
    """Reads a `SendMeter` every `POLL_S` from a thread; the meter's calls share one lock."""

    def __init__(self) -> None:
        self.meter, self.lock = SendMeter(time.monotonic), threading.Lock()
        self.readings: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def read(self) -> None:
        with self.lock:
            reading = self.meter.reading()
            self.readings.append((time.monotonic(), reading.sent_bytes, reading.held_s))

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self.read()

    @contextmanager
    def polling(self) -> Iterator[None]:
        self.read()
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
            self.read()


def _transfer(conn: socket.socket, size: int, block: memoryview, poller: MeterPoller) -> float:
    """One transfer: its length, its bytes, the sink's ack; seconds from send to ack."""
    start = time.monotonic()
    with poller.lock:
        poller.meter.waiting()
    conn.sendall(size.to_bytes(8, "big"))
    for offset in range(0, size, PIECE_BYTES):
        conn.sendall(block[:min(PIECE_BYTES, size - offset)])
    if recv_exact(conn, 1) != b"A":
        raise ConnectionError("sink did not ack")
    with poller.lock:
        poller.meter.delivered(size)
        poller.meter.crossed()
    return time.monotonic() - start


def run_sender(host: str, port: int, volume_bytes: int, size: str) -> None:
    """Sends the transfers back to back; prints one JSON object: times and meter readings."""
    sizes, poller = kv_transfer_sizes(volume_bytes, size=size), MeterPoller()
    block = memoryview(bytes(PIECE_BYTES))
    with socket.create_connection((host, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with poller.polling():
            start = time.monotonic()
            times = [_transfer(conn, n, block, poller) for n in sizes]
            seconds = time.monotonic() - start
        conn.sendall((0).to_bytes(8, "big"))
    print(json.dumps({"bytes": sum(sizes), "seconds": seconds, "times": times,
                      "readings": poller.readings}), flush=True)


@contextmanager
def child(prefix: list[str], *args: str) -> Iterator[str]:
    """This script in another role (in a namespace when `prefix` says so); yields the first
    line it prints."""
    env = dict(os.environ, MALLOC_TOP_PAD_="67108864", PYTHONPATH=str(ROOT))
    process = subprocess.Popen([*prefix, sys.executable, __file__, "--role", *args],
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def send(prefix: list[str], host: str, port: str, volume_bytes: int, size: str) -> Any:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([*prefix, sys.executable, __file__, "--role", "send", host, port,
                           str(volume_bytes), size], capture_output=True, text=True, env=env,
                          check=True, timeout=CHILD_TIMEOUT_S)
    return json.loads(done.stdout.splitlines()[-1])


@dataclass(frozen=True)
class PathResult:
    """One path at one rate (module docstring)."""

    rate_bps: float
    delivered_bps: float
    transfer_p50_s: float
    transfer_p90_s: float
    estimate_bps: float
    held: float

    @property
    def rate_ratio(self) -> float:
        return self.delivered_bps / self.rate_bps

    @property
    def estimate_ratio(self) -> float:
        return self.estimate_bps / self.delivered_bps


def path_result(rate_bps: float, sent: Any, config: EstimatorConfig) -> PathResult:
    """The figures of one sender's report; its meter readings fed to the router's estimator."""
    estimator = BandwidthEstimator(config, link="bench")
    start = sent["readings"][0][0]
    for when, nbytes, held_s in sent["readings"]:
        estimator.observe(when - start, {"sender": (nbytes, held_s)})
    end, held = sent["readings"][-1][0], sent["readings"][-1][2]
    return PathResult(rate_bps, 8 * sent["bytes"] / sent["seconds"],
                      percentile(sent["times"], 50), percentile(sent["times"], 90),
                      estimator.available_bps, held / max(end - start, 1e-9))


def through_emulator(rate_bps: float, volume_bytes: int, size: str) -> Any:
    with child([], "sink", "127.0.0.1") as sink_port, child([], "proxy", sink_port,
                                                            repr(rate_bps)) as route_port:
        return send([], "127.0.0.1", route_port, volume_bytes, size)


def through_kernel(rate_bps: float, volume_bytes: int, size: str) -> Any:
    lab = NetLab(("kvs", "kvr"), [Veth("kvs", "kvr", SENDER_HOST, SINK_HOST, rate_bps)])
    with lab, child(lab.exec_prefix("kvr"), "sink", SINK_HOST) as sink_port:
        return send(lab.exec_prefix("kvs"), SINK_HOST, sink_port, volume_bytes, size)


def measure_rate(rate_bps: float, seconds: float, config: EstimatorConfig,
                 size: str = "default") -> dict[str, PathResult]:
    """Both paths at `rate_bps`, the same transfers, about `seconds` each."""
    volume = int(rate_bps / 8 * seconds)
    return {"emulator": path_result(rate_bps, through_emulator(rate_bps, volume, size), config),
            "kernel": path_result(rate_bps, through_kernel(rate_bps, volume, size), config)}


def rate_tag(rate_bps: float) -> str:
    return f"{rate_bps / 1e9:g}g" if rate_bps >= 1e9 else f"{rate_bps / 1e6:g}m"


def netns_refusal() -> str:
    """Why this process may not make namespaces ("" if it may); makes nothing that stays."""
    try:
        require_netns()
        remove_stale()
        with NetLab(("probe",), []):
            return ""
    except NetnsError as exc:
        return str(exc)


def report(rates: list[float], results: list[dict[str, PathResult]], volumes: list[int],
           config: EstimatorConfig) -> dict[str, Any]:
    print(f"\n{'path':<10}{'set Mbit/s':>11}{'delivered':>11}{'ratio':>8}{'p50 ms':>9}"
          f"{'p90 ms':>9}{'estimate':>10}{'est/deliv':>10}{'held':>7}")
    out: dict[str, Any] = {}
    for rate, result, volume in zip(rates, results, volumes, strict=True):
        tag = rate_tag(rate)
        out[f"{tag}_set_bps"], out[f"{tag}_volume_bytes"] = rate, volume
        out[f"{tag}_transfers"] = len(kv_transfer_sizes(volume))
        for path, r in result.items():
            print(f"{path:<10}{rate / 1e6:>11.0f}{r.delivered_bps / 1e6:>11.1f}"
                  f"{r.rate_ratio:>8.3f}{r.transfer_p50_s * 1e3:>9.1f}"
                  f"{r.transfer_p90_s * 1e3:>9.1f}{r.estimate_bps / 1e6:>10.1f}"
                  f"{r.estimate_ratio:>10.3f}{r.held:>7.3f}")
            out.update({f"{path}_{tag}_rate_ratio": round(r.rate_ratio, 4),
                        f"{path}_{tag}_delivered_bps": round(r.delivered_bps),
                        f"{path}_{tag}_transfer_p50_ms": round(r.transfer_p50_s * 1e3, 2),
                        f"{path}_{tag}_transfer_p90_ms": round(r.transfer_p90_s * 1e3, 2),
                        f"{path}_{tag}_estimate_ratio": round(r.estimate_ratio, 4),
                        f"{path}_{tag}_held": round(r.held, 4)})
    out.update(cpu=cpu_name(), load_average=round(load_average(), 2),
               date=datetime.date.today().isoformat(), estimator_window_s=config.window_s)
    return out


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=DEFAULT_RATES, help="bit/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="per path and rate")
    parser.add_argument("--window", type=float, default=3.0, help="estimator window, s")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return run_role(args.role)
    if refusal := netns_refusal():
        print(f"bench_kernel_link: {refusal}", file=sys.stderr)
        return EXIT_NO_NETNS
    # SIGTERM unwinds like Ctrl-C: every `with` below removes what it made.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    rates = [float(r) for r in args.rates.split(",")]
    config = EstimatorConfig(window_s=args.window)
    print(f"{cpu_name()}, {os.cpu_count()} logical CPUs, load {load_average():.2f}; "
          f"{args.seconds:g} s per path and rate, estimator window {args.window:g} s")
    results = [measure_rate(rate, args.seconds, config) for rate in rates]
    volumes = [int(rate / 8 * args.seconds) for rate in rates]
    print(json.dumps(report(rates, results, volumes, config)))
    return 0


def run_role(role: list[str]) -> int:
    if role[0] == "sink":
        run_sink(role[1])
    elif role[0] == "proxy":
        run_proxy(int(role[1]), float(role[2]))
    else:
        run_sender(role[1], int(role[2]), int(role[3]), role[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
