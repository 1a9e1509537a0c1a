"""Starting several services of one topology: in this event loop, or as child processes.

`in_process` runs the named services as tasks of the caller's event loop over one network
(in memory by default): tests and simulation. `launch` runs `prfaas serve NAME` for each name
as a child process and waits for each one's ready line (services.cli.serve): end-to-end tests and
benchmarks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import IO

import anyio

from mesh.allocator import allocator_env
from mesh.node import Node
from mesh.topology import Topology
from mesh.transport import Address, MemoryHub, MemoryTransport, Transport
from mesh.wire import Codec
from services.cli.lifeline import child_env
from services.cli.serve import run_service
from services.contract.errors import DataPathError
from services.contract.messages import CODEC_MESSAGES
from services.service import Mode, ServiceContext


class InProcessMesh:
    """Services of one topology running in this event loop over one memory network."""

    def __init__(self, topology: Topology, transport: Transport, via_links: bool = False):
        self.topology = topology
        self.transport = transport
        self.via_links = via_links
        self.services: dict[str, object] = {}
        self.addresses: dict[str, Address] = {}

    def context(self, name: str, mode: Mode = "live", time_scale: float = 1.0) -> ServiceContext:
        """Peers are reached directly unless the mesh runs its links (real TCP only)."""
        return ServiceContext(self.topology, self.topology.service(name), mode, time_scale,
                              self.transport, None if self.via_links else self.topology.address,
                              expose=self.services.__setitem__)

    def client(self, name: str = "client") -> Node:
        """A node for talking to the services (enter it before use)."""
        return Node(name, Codec(CODEC_MESSAGES), self.transport, self.topology.address)


@asynccontextmanager
async def in_process(
    topology: Topology, names: Sequence[str], *, transport: Transport | None = None,
    mode: Mode = "live", time_scale: float = 1.0, via_links: bool = False,
) -> AsyncIterator[InProcessMesh]:
    """Starts `names` (in order) in this event loop; stops them when the block ends.

    The default transport is an in-memory network; `via_links` (with TcpTransport and the
    link services among `names`) sends cross-cluster traffic through the emulated links."""
    mesh = InProcessMesh(topology, transport or MemoryTransport(MemoryHub()), via_links)
    try:
        async with anyio.create_task_group() as tg:
            for name in names:
                ctx = mesh.context(name, mode, time_scale)
                mesh.addresses[name] = await tg.start(partial(run_service, ctx))
            try:
                yield mesh
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The body's own error alone: raise it as it was thrown, not wrapped.
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0],
                                                         BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


class LaunchError(DataPathError):
    """A launched service exited or did not announce itself in time."""


@contextmanager
def launch(
    topology: Path,
    names: Sequence[str],
    *,
    extra_args: Sequence[str] = (),
    log_dir: Path | None = None,
    ready_timeout: float = 120.0,
) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Runs `prfaas serve NAME` for each name as a child process until the block ends.

    All start at once (they load their models in parallel); the block starts once each has
    printed its ready line. Children get the allocator settings (mesh/allocator.py) that the
    environment does not set; their logs go to log_dir/NAME.log. Every child is terminated
    (then killed) on the way out.
    """
    env = allocator_env(os.environ)
    children: dict[str, subprocess.Popen[str]] = {}
    logs: list[IO[str]] = []
    try:
        for name in names:
            log_file: IO[str] | None = None
            if log_dir is not None:
                log_file = open(log_dir / f"{name}.log", "w")  # noqa: SIM115
                logs.append(log_file)
            children[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli.main", "serve", name, "--topology",
                 str(topology), *extra_args],
                stdout=subprocess.PIPE, stderr=log_file or subprocess.DEVNULL, text=True,
                env=child_env(env),
            )
        deadline = time.monotonic() + ready_timeout
        for name, child in children.items():
            _wait_ready(name, child, deadline, log_dir / f"{name}.log" if log_dir else None)
        yield children
    finally:
        _stop_all(children.values())
        for log_file in logs:
            log_file.close()


def _wait_ready(name: str, child: subprocess.Popen[str], deadline: float,
                log: Path | None) -> None:
    # A thread drains the child's stdout for its whole life (a full pipe would block it) and
    # flags the ready line; select() on a buffered text pipe misses lines read ahead.
    ready = threading.Event()
    threading.Thread(target=_watch_stdout, args=(name, child, ready), daemon=True).start()
    while not ready.wait(timeout=0.05):
        if child.poll() is not None:
            raise LaunchError(f"service {name!r} exited with code {child.returncode} before "
                              f"ready{_tail(log)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"service {name!r} did not get ready in time{_tail(log)}")


def _watch_stdout(name: str, child: subprocess.Popen[str], ready: threading.Event) -> None:
    assert child.stdout is not None
    try:
        for line in child.stdout:
            if line.startswith(f"ready {name} "):
                ready.set()
    except ValueError:
        # `_stop_all` closed the pipe under us: the child is gone, nothing is left to read.
        return


def _tail(log: Path | None, lines: int = 5) -> str:
    if log is None or not log.is_file():
        return ""
    return "; its log ends:\n" + "\n".join(log.read_text().splitlines()[-lines:])


def _stop_all(children: Iterable[subprocess.Popen[str]]) -> None:
    children = list(children)
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
