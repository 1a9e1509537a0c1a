"""Router benchmark: what the router itself costs, against workers that answer at once.

Four processes on 127.0.0.1, so that no one's cost is counted as another's:
- the backend: the cache directory and a PD prefill and a PD decode worker, the live services
  (`run_cachedir`, `WorkerService` with its `PrefillWorker` and `DecodeWorker`) over TCP, on
  the simulation's `ModeledEngine` under the unpaced `cpu` profile: compute costs nothing, so
  a pass of the decode batch makes all the tokens its members have left, as in the
  simulation; a streamed completion gets each token as its own message, as the real batch
  sends them, a plain one its first token, then the rest at the finish
  (`DecodeRequest.incremental`), as from the real decode worker;
- the router: `prfaas serve router` (Quart on hypercorn, `mesh/http.py`), its real tokenizer,
  scheduler, cache-directory lookup and mesh hops;
- the baseline: a bare Quart endpoint served the same way, answering an OpenAI-shaped
  completion (streamed: one event per token) at once without looking at the prompt;
- this process: the client, raw HTTP/1.1 (h11) on keep-alive connections (a new one when the
  server closes one: hypercorn does after 1,000 requests), on uvloop.

Last, short plain completions one at a time beside `--long-senders` connections that send
60,000-character prompts back to back (`long_prompts` in the JSON, against the same requests
alone): the router tokenizes such a body (about 4 ms) in a worker thread, off its loop.

`--scrape-every S` adds a third turn to every throughput round: the router again, while a
scraper GETs its /metrics every S seconds as Prometheus would (`scrape` in the JSON: the
router's CPU per request with and without, the same-run A/B over the whole phase and as the
median of each round's pair, its threads' CPU read to the nanosecond; and the router's CPU per
scrape measured alone, 200 scrapes back to back once the histograms are full, with the share
of a request's CPU that makes at the scraped rate).

`--against PATH` adds a fourth target to every round: the router from the code at PATH (a
checkout of another commit, or a commit of this repository, which is exported with `git
archive` into the run's temporary folder; its own `prfaas serve router`, run in PATH with PATH
alone on its PYTHONPATH, on ports of its own) over the same backend processes and client,
taking turns with this tree's router, first in every other round (`against` in the JSON: per
kind, each router's CPU per request read to the nanosecond, their ratio over the whole phase
and the median of each round's pair, at the throughput concurrency and at concurrency 1;
whether tracing was on). With tracing off, the worse kind's ratio is also the headline
`tracing_off_cpu_ratio` (`make bench-router` runs against the commit before tracing, so it is
what tracing costs when off, with the other changes since). The other router talks to this
tree's backend as long as the contract's messages only gained fields with defaults (msgspec
structs skip fields they do not know). `cpu` in the JSON names the machine's CPU
(services/bench/host.py).

`--count-calls N` (with `--against`) then counts the work instead of timing it: both routers
again, each under a call counter (cProfile on its main thread, where its event loop runs,
counting from a signal to a signal), N requests of each kind at the throughput concurrency,
one router after the other (`calls` in the JSON: each one's calls per request and their ratio;
with tracing off the worse kind's ratio is also `tracing_off_calls_ratio`; and each one's
calls a second when idle, its control loop's and status polls', and the ratio net of those
over the phase's time). Unlike CPU time on a shared machine, the count moves little from run
to run.

Latency is measured at concurrency 1 (`--latency-requests` each kind), throughput at
`--concurrency` (16 by default; `--requests` each kind), for short non-streamed and streamed
completions, router and baseline taking turns (`--rounds`) in the same run. added_ms = router
latency minus baseline latency at the same percentile. Each process's CPU per request is shown
beside: on a shared machine it says what each costs when rps and latency say mostly how busy
the machine was. The headline keys are the worse of the two kinds (lowest rps ratio, largest
added latency); `kinds` has each one. `rps_ratio_spread` is the lowest and highest ratio of
one round (router and baseline back to back): how far the host's load moved the ratio.

    .venv/bin/python benchmarks/bench_router.py [--requests N] [--concurrency C]
        [--tokens-per-message N] [--rounds N] [--long-senders N] [--scrape-every S]
        [--against PATH] [--count-calls N]

The last line is one JSON object; `failures` in it names the commonest reasons requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import h11
import httpx
import msgspec

from mesh.allocator import allocator_env
from mesh.cputime import cpu_seconds
from mesh.ports import free_ports
from mesh.run import run as run_on
from services.bench.host import cpu_name
from services.cli.launch import launch
from services.cli.lifeline import child_env
from services.contract.tracing import endpoint_from_env
from services.data import corpus_path

ROOT = Path(__file__).resolve().parent.parent

PROMPT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and "
          "Juliet is the sun. Arise, fair sun, and kill the envious moon. ") * 3
MAX_TOKENS = 16
# The long prompts sent beside short requests (about 18,000 tokens; ~4 ms to tokenize).
LONG_CHARS = 60_000
KINDS = ("plain", "stream")
T = TypeVar("T")
BACKEND_NAMES = ("cachedir", "pd-prefill-0", "pd-decode-0")


def topology_text(ports: list[int]) -> str:
    worker = ('options = { cache_mib = 1048576.0, connections = 1, slots = 32, '
              'max_streams = 256, prefill_slots = 256 }')
    return f"""
[[clusters]]
name = "pd"
kind = "pd"
{worker}
[[services]]
name = "router"
kind = "router"
port = {ports[0]}
options = {{ http_port = {ports[1]}, max_inflight = 256, max_context = 32768 }}
[[services]]
name = "cachedir"
kind = "cachedir"
port = {ports[2]}
[[services]]
name = "pd-prefill-0"
kind = "prefill"
cluster = "pd"
port = {ports[3]}
[[services]]
name = "pd-decode-0"
kind = "decode"
cluster = "pd"
port = {ports[4]}
"""


# --- the backend: cache directory and free workers ---------------------------------------


async def serve_backend(topology_path: str, tokens_per_message: int) -> None:
    from mesh.topology import load_topology
    from services.cachedir.service import run_cachedir
    from services.model.tokenizer import load_default
    from services.paper.hardware import CostModel
    from services.service import ServiceContext
    from services.sim.engine import ModeledConfig, ModeledEngine
    from services.worker.compute import InlineRunner
    from services.worker.service import WorkerService

    topology = load_topology(topology_path, "")
    # The router refuses workers whose vocabulary its tokenizer cannot read back.
    cfg = ModeledConfig(vocab_size=load_default().vocab_size)
    # Free compute: a loop pass of the batch makes every token its members have left (as the
    # simulation's engine does), handed out `tokens_per_message` an event.
    engine = ModeledEngine(CostModel.load("cpu"), 1.0, cfg=cfg, flush=tokens_per_message)
    async with anyio.create_task_group() as tg:
        await tg.start(run_cachedir, ServiceContext(topology, topology.service("cachedir")))
        for name in BACKEND_NAMES[1:]:
            ctx = ServiceContext(topology, topology.service(name))
            await tg.start(WorkerService(ctx, engine, engine.info(), InlineRunner()).run)
        print("ready backend", flush=True)


# --- the baseline: a bare endpoint ------------------------------------------------------


def baseline_app(tokens_per_message: int) -> Any:
    from quart import Quart, Response, request

    app = Quart(__name__)
    app.config["RESPONSE_TIMEOUT"] = None
    encode = msgspec.json.Encoder().encode

    def body(text: str, finish: str | None) -> dict[str, Any]:
        return {"id": "cmpl-baseline", "object": "text_completion", "created": 0,
                "model": "prfaas", "choices": [{"index": 0, "text": text,
                                                "finish_reason": finish}]}

    async def events(count: int) -> AsyncIterator[bytes]:
        # The first token comes alone (the prefill's), the rest as the workers send them.
        sizes = [1] + [tokens_per_message] * ((count - 1) // tokens_per_message)
        sizes += [(count - 1) % tokens_per_message] if (count - 1) % tokens_per_message else []
        for size in sizes:
            yield b"data: " + encode(body("!" * size, None)) + b"\n\n"
        yield b"data: " + encode(body("", "length")) + b"\n\n"
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions() -> Response:
        asked = msgspec.json.decode(await request.get_data(True, False, False))
        count = int(asked.get("max_tokens", 16))
        if asked.get("stream"):
            return Response(events(count), mimetype="text/event-stream")
        whole = {**body("!" * count, "length"),
                 "usage": {"prompt_tokens": 0, "completion_tokens": count,
                           "total_tokens": count}}
        return Response(encode(whole), mimetype="application/json")

    return app


async def serve_baseline(port: int, tokens_per_message: int) -> None:
    from mesh.http import serve_http

    async with anyio.create_task_group() as tg:
        await tg.start(serve_http, baseline_app(tokens_per_message), "127.0.0.1",
                       port)
        print("ready baseline", flush=True)


@contextmanager
def ready_process(argv: list[str], env: dict[str, str], cwd: Path | None = None,
                  log: IO[str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """`argv` as a child process, once it has printed its ready line; its stderr to `log`."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                               cwd=cwd)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"{argv[1:]} did not start (exit code {process.wait()})")
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def child(*args: str) -> AbstractContextManager[subprocess.Popen[str]]:
    """This script in another role, once it has printed its ready line."""
    return ready_process([sys.executable, __file__, *args], allocator_env(os.environ))


# `python -c CALL_COUNTER FILE MODULE ARGS...` runs MODULE as __main__ and counts the calls
# (Python and C, as cProfile counts them) its main thread makes from SIGUSR1 to SIGUSR2,
# written to FILE at SIGUSR2.
CALL_COUNTER = """
import cProfile, runpy, signal, sys
profile, out = cProfile.Profile(), sys.argv[1]
def stop(*_):
    profile.disable()
    with open(out, "w") as f:
        f.write(str(sum(entry.callcount for entry in profile.getstats())))
    profile.clear()
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, stop)
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@contextmanager
def other_router(tree: Path, topology: Path, log_dir: Path, log_name: str = "against",
                 start: Sequence[str] = ()) -> Iterator[subprocess.Popen[str]]:
    """`prfaas serve router` from the code at `tree` (`--against`): run there with only that
    tree on its PYTHONPATH, it imports that tree's services and mesh; its log is
    log_dir/`log_name`.log. `start`: the command line before the module's name (a work
    counter's; default `python -m`)."""
    env = {**child_env(allocator_env(os.environ)), "PYTHONPATH": str(tree)}
    argv = [*(start or [sys.executable, "-m"]), "services.cli.main", "serve", "router",
            "--topology", str(topology)]
    with open(log_dir / f"{log_name}.log", "w") as log, \
            ready_process(argv, env, cwd=tree, log=log) as process:
        yield process


# --- the client ---------------------------------------------------------------------------


class Failed(Exception):
    """A request that did not complete as asked."""


class Connection:
    """A keep-alive HTTP/1.1 connection to a port; `post` answers the body (any framing).
    A new socket is opened when the server has closed the last one (hypercorn does after
    1,000 requests on a connection) or a request failed on it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader, self.writer, self.h11 = reader, writer, h11.Connection(h11.CLIENT)
        return reader, writer

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        reader, writer = (self.reader, self.writer) if self.writer else await self._open()
        try:
            return await self._exchange(reader, writer, path, payload)
        finally:
            if not (self.h11.our_state is self.h11.their_state is h11.IDLE):
                self.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        path: str, payload: bytes) -> tuple[int, bytes]:
        headers = [("host", "127.0.0.1"), ("content-type", "application/json"),
                   ("content-length", str(len(payload)))]
        # One write, as HTTP clients send a small request (three would cost the servers reads).
        writer.write(b"".join(self.h11.send(event) or b"" for event in (
            h11.Request(method="POST", target=path, headers=headers), h11.Data(data=payload),
            h11.EndOfMessage())))
        status, parts = 0, []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.our_state is self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return status, b"".join(parts)
            elif isinstance(event, h11.ConnectionClosed):
                raise Failed("the server closed the connection")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def request_body(stream: bool, max_tokens: int) -> bytes:
    return msgspec.json.encode({"model": "prfaas", "prompt": PROMPT, "max_tokens": max_tokens,
                                "ignore_eos": True, "stream": stream})


def check(status: int, body: bytes, stream: bool) -> None:
    if status != 200:
        raise Failed(f"status {status}: {body[:200]!r}")
    if stream:
        if not body.endswith(b"data: [DONE]\n\n") or b'"error"' in body:
            raise Failed(f"stream did not end well: {body[-200:]!r}")
        return
    choices = msgspec.json.decode(body)["choices"]
    if choices[0]["finish_reason"] != "length" or not choices[0]["text"]:
        raise Failed(f"unexpected completion {body[:200]!r}")


@dataclass
class Run:
    """One phase: each request's latency (seconds), the phase's wall time, failures."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over the phase
    round_rps: list[float] = field(default_factory=list)  # each added round's own rate
    scrapes: int = 0  # GET /metrics answered during the phase (--scrape-every)
    # The router's CPU per request of each added round, in ms, to the nanosecond
    # (`thread_cpu_seconds`): the scrape A/B pairs rounds (--scrape-every).
    round_router_ms: list[float] = field(default_factory=list)
    router_ns_s: float = 0.0  # that CPU over the phase (its rounds added), in seconds

    def add(self, other: Run) -> None:
        """Another round of the same phase."""
        self.round_rps.append(other.rps())
        if other.latencies:
            self.round_router_ms.append(1e3 * other.router_ns_s / len(other.latencies))
        self.latencies += other.latencies
        self.wall_s += other.wall_s
        self.failures += other.failures
        self.scrapes += other.scrapes
        self.router_ns_s += other.router_ns_s
        for name, seconds in other.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds

    def cpu_ms(self, process: str) -> float:
        """That process's CPU per completed request: cost apart from the machine's load."""
        done = len(self.latencies)
        return round(1e3 * self.cpu_s.get(process, 0.0) / done, 3) if done else 0.0

    def router_ns_ms(self) -> float:
        """The router's CPU per completed request in ms, read to the nanosecond."""
        done = len(self.latencies)
        return round(1e3 * self.router_ns_s / done, 4) if done else 0.0

    def rps(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else 0.0

    def ms(self, q: float) -> float:
        if len(self.latencies) < 2:
            return 1e3 * (self.latencies[0] if self.latencies else float("nan"))
        return 1e3 * statistics.quantiles(self.latencies, n=100, method="inclusive")[
            round(q * 100) - 1]


async def phase(port: int, stream: bool, requests: int, concurrency: int,
                max_tokens: int) -> Run:
    """`requests` completions over `concurrency` connections, each sending its next at once."""
    payload, result, left = request_body(stream, max_tokens), Run(), [requests]

    async def one_connection() -> None:
        conn = Connection(port)
        try:
            while left[0] > 0:
                left[0] -= 1
                start = time.perf_counter()
                try:
                    status, body = await conn.post("/v1/completions", payload)
                    check(status, body, stream)
                except (Failed, OSError, h11.ProtocolError) as exc:
                    result.failures.append(str(exc))
                    continue
                result.latencies.append(time.perf_counter() - start)
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - start
    return result


class Options(msgspec.Struct, frozen=True):
    requests: int
    latency_requests: int
    concurrency: int
    max_tokens: int
    warmup: int
    tokens_per_message: int = 1
    rounds: int = 4
    long_senders: int = 2
    scrape_s: float = 0.0  # 0: no scraped turn
    against: str = ""  # another tree whose router takes turns with this one's ("": none)
    against_commit: str = ""  # its commit ("": not known)
    ours: str = ""  # the tree whose router is measured as "this" one ("": this checkout)
    ours_commit: str = ""  # its commit ("": not known)
    count_calls: int = 0  # requests of each kind each router serves under a call counter
    pin: bool = False  # the routers on the last CPU, every other process on the others
    count_instructions: int = 0  # requests of each kind each router serves under callgrind


def thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of the threads `pid` has now, to the nanosecond (/proc/PID/task/*/schedstat:
    /proc/PID/stat counts 10 ms ticks, 5% of a 100-request round)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with suppress(OSError):  # a thread that ended meanwhile
            total += int(stat.read_text().split()[0])
    return total / 1e9


async def measured_phase(port: int, stream: bool, requests: int, concurrency: int,
                         options: Options, pids: dict[str, int]) -> Run:
    """A phase, and the CPU each process (`client`: this one) spent during it."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    router = thread_cpu_seconds(pids["router"]) if "router" in pids else 0.0
    client = time.process_time()
    run = await phase(port, stream, requests, concurrency, options.max_tokens)
    run.cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    if "router" in pids:
        run.router_ns_s = thread_cpu_seconds(pids["router"]) - router
    run.cpu_s["client"] = time.process_time() - client
    return run


async def scraped_phase(port: int, stream: bool, requests: int, concurrency: int,
                        options: Options, pids: dict[str, int]) -> Run:
    """A measured phase while a scraper GETs the router's /metrics every `scrape_s`."""
    done, scrapes = asyncio.Event(), [0]

    async def scraper() -> None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            while not done.is_set():
                (await client.get(f"http://127.0.0.1:{port}/metrics")).raise_for_status()
                scrapes[0] += 1
                with suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), options.scrape_s)

    task = asyncio.create_task(scraper())
    try:
        run = await measured_phase(port, stream, requests, concurrency, options, pids)
    finally:
        done.set()
        await task
    run.scrapes = scrapes[0]
    return run


async def scrape_cost(port: int, pid: int, count: int = 200) -> tuple[float, int]:
    """The router's CPU ms per scrape of /metrics, `count` back to back; the body's bytes."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        before = cpu_seconds(pid)
        for _ in range(count):
            response = await client.get(f"http://127.0.0.1:{port}/metrics")
            response.raise_for_status()
        spent = cpu_seconds(pid) - before
    return 1e3 * spent / count, len(response.content)


async def beside_long(port: int, options: Options) -> tuple[Run, Run]:
    """Short plain completions one at a time while `long_senders` connections send
    LONG_CHARS-character prompts (1 token each) back to back: how long the long ones hold
    up the short. (short, long) runs."""
    text = corpus_path().read_text(encoding="utf-8")[:LONG_CHARS]
    payload = msgspec.json.encode({"model": "prfaas", "prompt": text, "max_tokens": 1,
                                   "ignore_eos": True})
    longs, stop = Run(), asyncio.Event()

    async def sender() -> None:
        conn = Connection(port)
        try:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    status, body = await conn.post("/v1/completions", payload)
                    check(status, body, False)
                except Failed as exc:
                    longs.failures.append(str(exc))
                    continue
                longs.latencies.append(time.perf_counter() - start)
        finally:
            conn.close()

    start = time.perf_counter()
    senders = [asyncio.create_task(sender()) for _ in range(options.long_senders)]
    # Until the long ones are flowing (or a sender died: gather below raises its error).
    while not (longs.latencies or longs.failures or any(t.done() for t in senders)):
        await asyncio.sleep(0.05)
    short = await phase(port, False, options.latency_requests, 1, options.max_tokens)
    stop.set()
    await asyncio.gather(*senders)
    longs.wall_s = time.perf_counter() - start
    return short, longs


def split(total: int, rounds: int) -> list[int]:
    """`total` requests over `rounds` rounds, as evenly as they go."""
    return [total // rounds + (i < total % rounds) for i in range(rounds)]


def turn_order(targets: list[str], scraped: bool, round_index: int) -> list[str]:
    """The turns of one round: the router and its A/B partners (the other tree's router, the
    scraped turn if asked) back to back, the router first in even rounds and last of them in
    odd ones, then the rest (the baseline): each side of a pair follows the same turns as
    often as the other, so the order within a round moves neither."""
    turns = [*targets, *(["scraped"] if scraped else [])]
    partners = [t for t in ("against", "scraped") if t in turns]
    pair = ["router", *partners] if round_index % 2 == 0 else [*partners, "router"]
    return [*pair, *(t for t in turns if t not in pair)]


async def measure(targets: dict[str, tuple[int, dict[str, int]]],
                  options: Options) -> dict[str, dict[str, Run]]:
    """Per target (its port and the processes serving it) and kind: `lat` (concurrency 1)
    and `rps` (the set concurrency) runs, each over `rounds` rounds in which the targets take
    turns, so that the shared machine's drift hits both alike."""
    runs: dict[str, dict[str, Run]] = {t: {} for t in targets}
    for kind in KINDS:
        stream = kind == "stream"
        for port, _ in targets.values():
            await phase(port, stream, options.warmup, min(4, options.concurrency),
                        options.max_tokens)
        for key, concurrency, total in (("lat", 1, options.latency_requests),
                                        ("rps", options.concurrency, options.requests)):
            for i, requests in enumerate(split(total, options.rounds)):
                for target in turn_order(list(targets), key == "rps" and options.scrape_s > 0,
                                         i):
                    scraping = target == "scraped"
                    port, pids = targets["router" if scraping else target]
                    run = await (scraped_phase if scraping else measured_phase)(
                        port, stream, requests, concurrency, options, pids)
                    runs.setdefault(target, {}).setdefault(
                        kind if scraping else f"{kind}/{key}", Run()).add(run)
    if options.scrape_s > 0:
        port, pids = targets["router"]
        cost_ms, size = await scrape_cost(port, pids["router"])
        # Not requests: kept apart from the phases' latencies, which count as completions.
        runs["scraped"]["cost"] = Run(cpu_s={"router_ms_per_scrape": cost_ms}, scrapes=size)
    if options.long_senders:
        short, longs = await beside_long(targets["router"][0], options)
        runs["router"]["plain/beside_long"], runs["router"]["long"] = short, longs
    return runs


# --- the report ---------------------------------------------------------------------------


def kind_report(router: dict[str, Run], base: dict[str, Run], kind: str) -> dict[str, Any]:
    r_lat, b_lat = router[f"{kind}/lat"], base[f"{kind}/lat"]
    r_rps_run, b_rps_run = router[f"{kind}/rps"], base[f"{kind}/rps"]
    r_rps, b_rps = r_rps_run.rps(), b_rps_run.rps()
    # Router and baseline take turns: each round's ratio saw one stretch of the host's load.
    rounds = [round(r / b, 3) if b else 0.0
              for r, b in zip(r_rps_run.round_rps, b_rps_run.round_rps, strict=True)]
    return {"router_rps": round(r_rps, 1), "baseline_rps": round(b_rps, 1),
            "rps_ratio": round(r_rps / b_rps, 3) if b_rps else 0.0,
            "rps_ratio_spread": [min(rounds), max(rounds)],
            "router_ms_p50": round(r_lat.ms(0.5), 2), "router_ms_p99": round(r_lat.ms(0.99), 2),
            "baseline_ms_p50": round(b_lat.ms(0.5), 2),
            "baseline_ms_p99": round(b_lat.ms(0.99), 2),
            "added_ms_p50": round(r_lat.ms(0.5) - b_lat.ms(0.5), 2),
            "added_ms_p99": round(r_lat.ms(0.99) - b_lat.ms(0.99), 2),
            "cpu_ms_per_request": {
                "router": r_rps_run.cpu_ms("router"), "backend": r_rps_run.cpu_ms("backend"),
                "client_of_router": r_rps_run.cpu_ms("client"),
                "baseline": b_rps_run.cpu_ms("baseline"),
                "client_of_baseline": b_rps_run.cpu_ms("client")}}


def report(runs: dict[str, dict[str, Run]], options: Options) -> dict[str, Any]:
    kinds = {kind: kind_report(runs["router"], runs["baseline"], kind) for kind in KINDS}
    worst = min(kinds.values(), key=lambda k: k["rps_ratio"])
    failures = Counter(f"{name}: {reason}" for name, target in runs.items()
                       for run in target.values() for reason in run.failures)
    failed = sum(failures.values())
    done = sum(len(run.latencies) for target in runs.values() for run in target.values())
    return {
        "router_rps": worst["router_rps"], "baseline_rps": worst["baseline_rps"],
        "rps_ratio": worst["rps_ratio"], "rps_ratio_spread": worst["rps_ratio_spread"],
        "added_ms_p50": max(k["added_ms_p50"] for k in kinds.values()),
        "added_ms_p99": max(k["added_ms_p99"] for k in kinds.values()),
        "latency_concurrency": 1, "rps_concurrency": options.concurrency,
        "max_tokens": options.max_tokens, "tokens_per_message": options.tokens_per_message,
        "requests": options.requests, "rounds": options.rounds,
        "latency_requests": options.latency_requests, "completed": done, "failed": failed,
        "failures": dict(failures.most_common(5)),
        "kinds": kinds,
        **({"long_prompts": long_report(runs["router"], options)}
           if "long" in runs["router"] else {}),
        **({"scrape": scrape_report(runs["router"], runs["scraped"], options)}
           if "scraped" in runs else {}),
        **(against_keys(against_report(runs["router"], runs["against"], options))
           if "against" in runs else {}),
        "cpu": cpu_name(),
    }


def against_keys(against: dict[str, Any]) -> dict[str, Any]:
    """`against` in the JSON, and with tracing off its headline: this tree's router CPU per
    request over the other's, the worse kind's whole phase and median of rounds."""
    if against["tracing"] != "off":
        return {"against": against}
    return {"tracing_off_cpu_ratio": against["ratio"],
            "tracing_off_cpu_median_ratio": against["median_ratio"],
            "tracing_off_against": against["commit"],
            "tracing_off_ours": against["ours"]["commit"], "against": against}


def cpu_pair(ours: Run, theirs: Run) -> dict[str, Any]:
    """Both routers' CPU per request over one phase (ns-exact), their ratio, and the ratio
    of each round's pair (the two turns back to back) with its median."""
    a, b = ours.router_ns_ms(), theirs.router_ns_ms()
    pairs = [x / y for x, y in zip(ours.round_router_ms, theirs.round_router_ms, strict=True)
             if y]
    return {"router_cpu_ms_per_request": a, "against_cpu_ms_per_request": b,
            "ratio": round(a / b, 4) if b else 0.0,
            "rounds_ratio": [round(x, 4) for x in pairs],
            "median_ratio": round(statistics.median(pairs), 4) if pairs else 0.0}


def against_report(router: dict[str, Run], against: dict[str, Run],
                   options: Options) -> dict[str, Any]:
    """This tree's router against the other tree's (`--against`), per kind: CPU per request
    at the throughput concurrency, and at concurrency 1 (`at_concurrency_1`)."""
    kinds = {kind: {**cpu_pair(router[f"{kind}/rps"], against[f"{kind}/rps"]),
                    "at_concurrency_1": cpu_pair(router[f"{kind}/lat"], against[f"{kind}/lat"])}
             for kind in KINDS}
    return {"tree": options.against,
            "commit": options.against_commit or tree_commit(Path(options.against)),
            "ours": {"tree": options.ours or str(ROOT),
                     "commit": options.ours_commit or tree_commit(Path(options.ours or ROOT))},
            "tracing": "on" if endpoint_from_env(os.environ) else "off",
            "ratio": max(k["ratio"] for k in kinds.values()),
            "median_ratio": max(k["median_ratio"] for k in kinds.values()), "kinds": kinds}


def against_tree(spec: str, workdir: Path, flag: str = "--against") -> tuple[Path, str]:
    """The code `flag` (--against, --ours) names and its commit: a directory as it is, else a
    commit of this repository, its files exported (`git archive`) into a folder under
    `workdir`."""
    if Path(spec).is_dir():
        return Path(spec).resolve(), ""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--short",
                            f"{spec}^{{commit}}"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise SystemExit(f"{flag} {spec!r}: neither a directory nor a commit of {ROOT}")
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True,
                             check=True)
    tree = workdir / f"{flag.lstrip('-')}-{commit}"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as files:
        files.extractall(tree, filter="data")
    return tree, commit


def tree_commit(tree: Path) -> str:
    """The commit checked out at `tree` ("" where it is no git checkout)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def scrape_report(router: dict[str, Run], scraped: dict[str, Run],
                  options: Options) -> dict[str, Any]:
    """The router's CPU per request with and without a scraper (same run, interleaved
    rounds), and what one scrape costs it measured alone, as a share of a request's CPU at
    the scraped turns' rate of scrapes per request."""
    cost = scraped["cost"]
    per_scrape_ms, size = cost.cpu_s["router_ms_per_scrape"], cost.scrapes
    kinds: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        plain, with_scrapes = router[f"{kind}/rps"], scraped[kind]
        a, b = plain.cpu_ms("router"), with_scrapes.cpu_ms("router")
        per_request = with_scrapes.scrapes / max(1, len(with_scrapes.latencies))
        # Each round's scraped turn against the plain turn of the same round: the median of
        # the pairs is what the host's drift moves least.
        pairs = [100 * (s / p - 1) for p, s in zip(plain.round_router_ms,
                                                    with_scrapes.round_router_ms, strict=True)]
        kinds[kind] = {"router_cpu_ms_per_request": a, "scraped_cpu_ms_per_request": b,
                       "ab_added_pct": round(100 * (b - a) / a, 2) if a else 0.0,
                       "ab_rounds_added_pct": [round(x, 2) for x in pairs],
                       "ab_median_added_pct": round(statistics.median(pairs), 2),
                       "scrapes": with_scrapes.scrapes, "scrapes_per_request":
                       round(per_request, 5), "scrape_share_pct":
                       round(100 * per_scrape_ms * per_request / b, 3) if b else 0.0}
    return {"every_s": options.scrape_s, "metrics_bytes": size,
            "router_cpu_ms_per_scrape": round(per_scrape_ms, 3),
            "scrape_share_pct": max(k["scrape_share_pct"] for k in kinds.values()),
            "ab_added_pct": max(k["ab_added_pct"] for k in kinds.values()),
            "ab_median_added_pct": max(k["ab_median_added_pct"] for k in kinds.values()),
            "kinds": kinds}


def long_report(router: dict[str, Run], options: Options) -> dict[str, Any]:
    """Short completions' latency beside long prompts, against the same requests alone."""
    alone, beside, longs = router["plain/lat"], router["plain/beside_long"], router["long"]
    return {"prompt_chars": LONG_CHARS, "senders": options.long_senders,
            "short_alone_ms_p50": round(alone.ms(0.5), 2),
            "short_alone_ms_p99": round(alone.ms(0.99), 2),
            "short_beside_long_ms_p50": round(beside.ms(0.5), 2),
            "short_beside_long_ms_p99": round(beside.ms(0.99), 2),
            "long_per_s": round(longs.rps(), 1), "long_completed": len(longs.latencies),
            "long_failed": len(longs.failures)}


def print_table(result: dict[str, Any]) -> None:
    print(f"router vs bare endpoint: latency at concurrency 1, throughput at concurrency "
          f"{result['rps_concurrency']}, {result['max_tokens']} tokens per completion")
    print(f"{'kind':8} {'router rps':>10} {'base rps':>9} {'ratio':>6} {'its rounds':>11} "
          f"{'router p50':>10} {'base p50':>9} {'added p50':>9} {'router p99':>10} "
          f"{'base p99':>9} {'added p99':>9}")
    for kind, k in result["kinds"].items():
        low, high = k["rps_ratio_spread"]
        print(f"{kind:8} {k['router_rps']:10.1f} {k['baseline_rps']:9.1f} {k['rps_ratio']:6.3f}"
              f" {low:5.3f}-{high:5.3f}"
              f" {k['router_ms_p50']:10.2f} {k['baseline_ms_p50']:9.2f} {k['added_ms_p50']:9.2f}"
              f" {k['router_ms_p99']:10.2f} {k['baseline_ms_p99']:9.2f}"
              f" {k['added_ms_p99']:9.2f}")
    print("CPU ms per request at the throughput concurrency (apart from the machine's load):")
    for kind, k in result["kinds"].items():
        print(f"  {kind:8} " + ", ".join(f"{name} {ms:.2f}"
                                         for name, ms in k["cpu_ms_per_request"].items()))
    long = result.get("long_prompts")
    if long:
        print(f"plain at concurrency 1 beside {long['senders']} connections sending "
              f"{long['prompt_chars']:,}-character prompts ({long['long_per_s']} a second): "
              f"p50 {long['short_beside_long_ms_p50']:.2f} ms, p99 "
              f"{long['short_beside_long_ms_p99']:.2f} ms (alone {long['short_alone_ms_p50']:.2f}"
              f", {long['short_alone_ms_p99']:.2f})")
    scrape = result.get("scrape")
    if scrape:
        print(f"scraped every {scrape['every_s']} s ({scrape['metrics_bytes']:,} bytes): router "
              f"{scrape['router_cpu_ms_per_scrape']:.2f} ms CPU a scrape, "
              f"{scrape['scrape_share_pct']:.3f}% of its CPU per request; same-run A/B "
              + ", ".join(f"{kind} {k['router_cpu_ms_per_request']:.3f} -> "
                          f"{k['scraped_cpu_ms_per_request']:.3f} ms ({k['ab_added_pct']:+.2f}%, "
                          f"median of rounds {k['ab_median_added_pct']:+.2f}%)"
                          for kind, k in scrape["kinds"].items()))
    against = result.get("against")
    if against:
        print(f"router CPU ms per request, {against['ours']['commit'] or 'this tree'} against "
              f"{against['tree']} ({against['commit']}, "
              f"tracing {against['tracing']}) on {result['cpu']}: " + ", ".join(
                  f"{kind} {k['router_cpu_ms_per_request']:.4f} vs "
                  f"{k['against_cpu_ms_per_request']:.4f} (ratio {k['ratio']:.4f}, median of "
                  f"rounds {k['median_ratio']:.4f})" for kind, k in against["kinds"].items()))
    calls = result.get("calls")
    if calls:
        print("router calls per request, the measured router's against --against's: " + ", ".join(
            f"{kind} {k['router_calls_per_request']:.1f} vs {k['against_calls_per_request']:.1f}"
            f" (ratio {k['ratio']:.4f}, net of idle {k['net_of_idle_ratio']:.4f})"
            for kind, k in calls["kinds"].items()) + f"; idle calls a second "
            f"{calls['router_idle_calls_per_s']:.0f} vs {calls['against_idle_calls_per_s']:.0f}")
    print(f"completed {result['completed']}, failed {result['failed']}")
    for reason, count in result["failures"].items():
        print(f"  {count} x {reason}")


def wait_healthy(port: int, deadline_s: float = 60.0) -> None:
    """The router answers 200 once it has polled a prefill and a decode worker."""
    deadline = time.monotonic() + deadline_s
    while httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the router did not get ready")
        time.sleep(0.2)


def bench(options: Options, log_dir: Path) -> dict[str, Any]:
    # Every child (the router too, through `launch`) runs this checkout's code; the other
    # tree's router (`--against`) runs its own.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    ports = free_ports(12)
    topology = log_dir / "topology.toml"
    topology.write_text(topology_text(ports))
    per_message = ("--tokens-per-message", str(options.tokens_per_message))
    with child("--serve-backend", str(topology), *per_message) as backend, \
            child("--serve-baseline", str(ports[5]), *per_message) as baseline, \
            measured_router(options, topology, log_dir) as router, \
            against_router(options, ports, log_dir) as against:
        wait_healthy(ports[1])
        targets = {"router": (ports[1], {"router": router.pid,
                                         "backend": backend.pid}),
                   "baseline": (ports[5], {"baseline": baseline.pid})}
        if against is not None:
            wait_healthy(ports[7])
            targets["against"] = (ports[7], {"router": against.pid, "backend": backend.pid})
        if options.pin:
            pin_routers([router.pid, *([against.pid] if against is not None else [])],
                        [backend.pid, baseline.pid, os.getpid()])
        result = report(run_on(measure, targets, options, backend="uvloop"), options)
        if options.count_calls:
            result.update(counted_work(options, ports, log_dir, CallCounter(),
                                       options.count_calls))
        if options.count_instructions:
            result.update(counted_work(options, ports, log_dir, InstructionCounter(),
                                       options.count_instructions))
        return result


def pin_routers(routers: list[int], others: list[int]) -> None:
    """`--pin`: the routers (which take turns, never run at once) on the last CPU this
    process may use, every other process on the rest: each router's turn finds the same
    CPU, alone, whichever router it is."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs or more")
    for pids, allowed in ((routers, {cpus[-1]}), (others, set(cpus[:-1]))):
        for pid in pids:
            for task in os.listdir(f"/proc/{pid}/task"):
                with suppress(ProcessLookupError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task), allowed)


class CallCounter:
    """Counts the calls of the router's event loop thread (cProfile, CALL_COUNTER), from
    SIGUSR1 to SIGUSR2."""

    unit = "calls"

    def start(self, out: Path) -> list[str]:
        return [sys.executable, "-c", CALL_COUNTER, str(out)]

    async def count(self, port: int, pid: int, out: Path,
                    work: Coroutine[Any, Any, T]) -> tuple[T, float]:
        """`work`'s result, and the calls the router (`pid`) made while it ran."""
        out.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        # The signal's handler runs once the router's loop wakes (a tick or a request).
        await asyncio.sleep(0.2)
        result = await work
        os.kill(pid, signal.SIGUSR2)
        return result, await read_count(port, out)


class InstructionCounter:
    """Counts the instructions the router's process executes, all its threads and C code
    included (valgrind's callgrind, instrumenting only while counting: `callgrind_control`
    switches it on, zeroes, reads the totals, switches it off). Deterministic where time is
    not: the same requests on the same code execute the same instructions, give or take the
    timers that fire while they run."""

    unit = "instructions"

    def start(self, out: Path) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}", sys.executable, "-m"]

    async def count(self, port: int, pid: int, out: Path,
                    work: Coroutine[Any, Any, T]) -> tuple[T, float]:
        await callgrind_control(pid, "--instr=on")
        await callgrind_control(pid, "--zero")
        result = await work
        totals = await callgrind_control(pid, "-e")
        await callgrind_control(pid, "--instr=off")
        counts = re.findall(r"^\s*Th\s+\d+\s+([\d,]+)", totals, flags=re.MULTILINE)
        if not counts:
            raise RuntimeError(f"no instruction totals from callgrind_control: {totals!r}")
        return result, float(sum(int(c.replace(",", "")) for c in counts))


async def callgrind_control(pid: int, *args: str) -> str:
    done = await asyncio.to_thread(subprocess.run, ["callgrind_control", *args, str(pid)],
                                   capture_output=True, text=True, check=True, timeout=120)
    return done.stdout


WorkCounter = CallCounter | InstructionCounter


def counted_work(options: Options, ports: list[int], log_dir: Path, counter: WorkCounter,
                 requests: int) -> dict[str, Any]:
    """This tree's router and --against's again, each under `counter` on ports[8:12] over
    the same backend, one after the other: per kind each one's count per request over
    `requests` requests at the throughput concurrency, their ratio, and the same net of
    what each counts when idle. `calls` (with tracing off `tracing_off_calls_ratio`) or
    `instructions` (`tracing_off_instructions_ratio`)."""
    trees = {"router": (Path(options.ours or ROOT), ports[8:10]),
             "against": (Path(options.against), ports[10:12])}
    unit = counter.unit
    counts: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        for name, (tree, (mesh_port, http_port)) in trees.items():
            topology = log_dir / f"topology-{name}-counted.toml"
            topology.write_text(topology_text([mesh_port, http_port, *ports[2:5]]))
            out = log_dir / f"{name}.{unit}"
            process = stack.enter_context(other_router(tree, topology, log_dir,
                                                       f"{name}-{unit}", counter.start(out)))
            # Under valgrind the router starts tens of times slower.
            wait_healthy(http_port, 60.0 if unit == "calls" else 900.0)
            counts[name] = run_on(count_work, http_port, process.pid, out, options, counter,
                                  requests, backend="uvloop")
    ours, theirs = counts["router"], counts["against"]
    kinds = {kind: {f"router_{unit}_per_request": round(ours[kind], 1),
                    f"against_{unit}_per_request": round(theirs[kind], 1),
                    "ratio": round(ours[kind] / theirs[kind], 4),
                    "net_of_idle_ratio": round(ours[f"{kind}/net"] / theirs[f"{kind}/net"], 4)}
             for kind in KINDS}
    ratio = max(k["ratio"] for k in kinds.values())
    report = {"requests": requests, "concurrency": options.concurrency,
              "ratio": ratio, "net_of_idle_ratio": max(k["net_of_idle_ratio"]
                                                       for k in kinds.values()),
              f"router_idle_{unit}_per_s": round(ours["idle_per_s"], 1),
              f"against_idle_{unit}_per_s": round(theirs["idle_per_s"], 1), "kinds": kinds}
    if endpoint_from_env(os.environ):
        return {unit: report}
    return {f"tracing_off_{unit}_ratio": ratio, unit: report}


async def count_work(port: int, pid: int, out: Path, options: Options, counter: WorkCounter,
                     requests: int) -> dict[str, float]:
    """Per kind, what `counter` counted on the router at `port` (`pid`) per request over
    `requests` requests after a warm-up, and the same net of what it counts when idle
    (`KIND/net`: its control loop and status polls, which run per second, not per
    request); `idle_per_s`."""
    counted, idle_s = {}, 3.0
    for kind in KINDS:
        stream = kind == "stream"
        await phase(port, stream, options.warmup, min(4, options.concurrency),
                    options.max_tokens)
        run, count = await counter.count(port, pid, out, phase(
            port, stream, requests, options.concurrency, options.max_tokens))
        counted[kind] = (count, run.wall_s, max(1, len(run.latencies)))
    _, idle = await counter.count(port, pid, out, asyncio.sleep(idle_s))
    per_s = idle / idle_s
    return {"idle_per_s": per_s,
            **{kind: count / done for kind, (count, _, done) in counted.items()},
            **{f"{kind}/net": (count - per_s * wall) / done
               for kind, (count, wall, done) in counted.items()}}


async def read_count(port: int, calls_file: Path, polls: int = 100) -> float:
    """The count CALL_COUNTER writes at SIGUSR2 (a /health request wakes an idle loop)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        for _ in range(polls):
            if calls_file.exists() and calls_file.read_text():
                return float(calls_file.read_text())
            await client.get(f"http://127.0.0.1:{port}/health")
            await asyncio.sleep(0.1)
    raise RuntimeError(f"no call count in {calls_file}")


@contextmanager
def measured_router(options: Options, topology: Path,
                    log_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """The router measured as this one: this checkout's, or `--ours`'s tree's."""
    if options.ours:
        with other_router(Path(options.ours), topology, log_dir, "router") as process:
            yield process
        return
    with launch(topology, ["router"], log_dir=log_dir) as children:
        yield children["router"]


@contextmanager
def against_router(options: Options, ports: list[int],
                   log_dir: Path) -> Iterator[subprocess.Popen[str] | None]:
    """The other tree's router (`--against`) on ports[6:8], over the same backend; None
    without one."""
    if not options.against:
        yield None
        return
    topology = log_dir / "topology-against.toml"
    topology.write_text(topology_text([ports[6], ports[7], *ports[2:5]]))
    with other_router(Path(options.against), topology, log_dir) as process:
        yield process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000,
                        help="requests per kind and target at --concurrency")
    parser.add_argument("--latency-requests", type=int, default=0,
                        help="requests per kind and target at concurrency 1 (default "
                             "--requests / 4)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4,
                        help="router and baseline take turns this many times per phase")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--tokens-per-message", type=int, default=1,
                        help="tokens the decode batch makes per step and hands out at once "
                             "(1: as the real batch; >= max-tokens: the whole answer at once); "
                             "a plain completion's tokens after its first come at the finish")
    parser.add_argument("--long-senders", type=int, default=2,
                        help="connections sending long prompts beside the short requests of "
                             "the last phase (0: no such phase)")
    parser.add_argument("--scrape-every", type=float, default=0.0, metavar="S",
                        help="also run the router while its /metrics is scraped every S "
                             "seconds, in the same rounds (0: not)")
    parser.add_argument("--against", metavar="PATH",
                        help="also run the router from the code at PATH (a checkout of "
                             "another commit, or a commit of this repository), taking turns "
                             "with this one's in every round over the same backend: CPU per "
                             "request of each")
    parser.add_argument("--ours", metavar="PATH",
                        help="with --against: measure the router from the code at PATH (a "
                             "checkout or a commit) as this one, e.g. a change's merge against "
                             "its parent (default: this checkout)")
    parser.add_argument("--count-calls", type=int, default=0, metavar="N",
                        help="with --against: then both routers under a call counter, N "
                             "requests of each kind each: calls per request (0: not)")
    parser.add_argument("--count-instructions", type=int, default=0, metavar="N",
                        help="with --against: then both routers under valgrind's callgrind, "
                             "N requests of each kind each: instructions per request (0: not)")
    parser.add_argument("--pin", action="store_true",
                        help="the routers on the last CPU, the backend, baseline and client "
                             "on the others (both routers' turns find the same CPU)")
    parser.add_argument("--serve-backend", help=argparse.SUPPRESS)
    parser.add_argument("--serve-baseline", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_backend:
        run_on(serve_backend, args.serve_backend, args.tokens_per_message, backend="uvloop")
        return 0
    if args.serve_baseline:
        run_on(serve_baseline, args.serve_baseline, args.tokens_per_message,
               backend="uvloop")
        return 0
    options = Options(requests=args.requests,
                      latency_requests=args.latency_requests or max(1, args.requests // 4),
                      concurrency=args.concurrency, max_tokens=args.max_tokens,
                      warmup=min(50, args.requests),
                      tokens_per_message=args.tokens_per_message,
                      rounds=max(1, min(args.rounds, args.requests)),
                      long_senders=max(0, args.long_senders),
                      scrape_s=max(0.0, args.scrape_every),
                      count_calls=max(0, args.count_calls), pin=args.pin,
                      count_instructions=max(0, args.count_instructions))
    if (args.count_calls or args.count_instructions) and not args.against:
        parser.error("--count-calls and --count-instructions compare with --against's "
                     "router: name one")
    if args.ours and not args.against:
        parser.error("--ours is measured against --against's router: name one")
    with tempfile.TemporaryDirectory(prefix="bench-router-") as log_dir:
        if args.against:
            tree, commit = against_tree(args.against, Path(log_dir))
            options = msgspec.structs.replace(options, against=str(tree),
                                              against_commit=commit)
        if args.ours:
            tree, commit = against_tree(args.ours, Path(log_dir), "--ours")
            options = msgspec.structs.replace(options, ours=str(tree), ours_commit=commit)
        result = bench(options, Path(log_dir))
    print_table(result)
    print(json.dumps(result))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
