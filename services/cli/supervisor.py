"""The supervisor: runs the Procfile's processes, restarts one that dies, stops all in order.

Each process runs under /bin/sh in a session of its own (so a Ctrl-C at the terminal reaches
only the supervisor, which then stops the children in order, last started first) with its
stdout and stderr forwarded line by line, prefixed with its name. A process that exits while
nobody asked it to is a death: it is started again after a backoff that starts at
`initial_backoff_s` and doubles up to `max_backoff_s`; a process that ran `healthy_after_s`
before dying starts over from the initial backoff. `restart` is a planned stop and an
immediate start; `kill` sends a signal (SIGKILL by default: a crash, restarted as any death).
Signals go to the child's process group, so a command that forks is stopped whole.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import anyio
import anyio.abc
import msgspec

from mesh.errors import ConfigError
from services.cli.lifeline import child_env
from services.cli.procfile import ProcessSpec
from services.contract.errors import DataPathError

State = Literal["starting", "up", "down", "restarting", "stopped"]
Output = Callable[[str, str], None]


class SupervisorError(DataPathError):
    """A control request the supervisor cannot serve: unknown process, bad signal."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 5.0
    healthy_after_s: float = 30.0  # a death after this long starts the backoff over
    stop_timeout_s: float = 10.0  # SIGTERM, then SIGKILL after this long

    def __post_init__(self) -> None:
        for name in ("initial_backoff_s", "max_backoff_s", "healthy_after_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")


class ProcessStatus(msgspec.Struct, frozen=True):
    name: str
    state: State
    pid: int | None
    restarts: int  # starts after the first, planned or not
    deaths: int  # exits nobody asked for (kills through the API included)
    since: float  # wall-clock time of the last state change
    last_exit: int | None  # the last exit status (negative: killed by that signal)


class SupervisorStatistics(msgspec.Struct, frozen=True):
    processes: tuple[ProcessStatus, ...]
    stopping: bool


def write_prefixed(width: int) -> Output:
    """Forwards a child's line to our stdout as `name | line`, names padded to `width`."""

    def write(name: str, line: str) -> None:
        sys.stdout.write(f"{name:<{width}} | {line}\n")
        sys.stdout.flush()

    return write


class Child:
    """One supervised process: start, wait, back off, start again, until stopped."""

    def __init__(self, spec: ProcessSpec, policy: RestartPolicy, env: Mapping[str, str],
                 output: Output, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec, self.policy, self.env, self.output, self.clock = spec, policy, env, output, clock
        self.state: State = "starting"
        self.restarts = self.deaths = 0
        self.since = time.time()
        self.last_exit: int | None = None
        self._process: anyio.abc.Process | None = None
        self._wake = anyio.Event()
        self._spawned = anyio.Event()
        self._planned = self._stopping = False

    def status(self) -> ProcessStatus:
        pid = self._process.pid if self._process is not None else None
        return ProcessStatus(self.spec.name, self.state, pid, self.restarts, self.deaths,
                             self.since, self.last_exit)

    def _set(self, state: State) -> None:
        self.state, self.since = state, time.time()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Runs the process until `stop`; reports started once the first start is done."""
        delay = self.policy.initial_backoff_s
        first = True
        while True:
            started = self.clock()
            await self._spawn()
            if self.stopping():
                # stop() came while this start was under way: it saw nothing to signal.
                self.signal(signal.SIGTERM)
            if first:
                task_status.started()
                first = False
            await self._watch()
            if self.stopping():
                break
            delay = await self._after_exit(delay, self.clock() - started)
            if self.stopping():
                break
        self._set("stopped")

    def stopping(self) -> bool:
        return self._stopping

    async def _spawn(self) -> None:
        self._process = await anyio.open_process(
            self.spec.command, stdin=None, stdout=-1, stderr=-2, env=child_env(self.env),
            start_new_session=True)
        self._set("up")
        self._spawned.set()

    async def _watch(self) -> None:
        """Forwards the output until the process exits; the exit status lands in last_exit."""
        process = self._process
        assert process is not None and process.stdout is not None
        drained = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._forward, process.stdout, drained)
            self.last_exit = await process.wait()
            # A grandchild may hold the pipe open: forward what is left for a moment only.
            with anyio.move_on_after(1.0):
                await drained.wait()
            tg.cancel_scope.cancel()

    async def _forward(self, stream: anyio.abc.ByteReceiveStream, drained: anyio.Event) -> None:
        pending = b""
        # A pipe that breaks with its process has nothing more to say; what came is forwarded.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in stream:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self.output(self.spec.name, line.decode(errors="replace"))
        if pending:
            self.output(self.spec.name, pending.decode(errors="replace"))
        drained.set()

    async def _after_exit(self, delay: float, ran_s: float) -> float:
        """Waits before the next start; returns the backoff for the death after that."""
        if self._planned:
            self._planned = False
            self.restarts += 1
            self._set("restarting")
            return self.policy.initial_backoff_s
        self.deaths += 1
        if ran_s >= self.policy.healthy_after_s:
            delay = self.policy.initial_backoff_s
        self.output(self.spec.name, f"exited with status {self.last_exit}; "
                                    f"starting again in {delay:.1f} s")
        self._set("down")
        self._wake = anyio.Event()
        with anyio.move_on_after(delay):
            await self._wake.wait()
        self.restarts += 1
        self._set("restarting")
        return min(delay * 2, self.policy.max_backoff_s)

    def signal(self, signum: int) -> bool:
        """Sends `signum` to the process group; False when nothing runs."""
        process = self._process
        if process is None or process.returncode is not None:
            return False
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return False
        return True

    async def _terminate(self) -> None:
        """SIGTERM, then SIGKILL after stop_timeout_s; returns once the process is gone.
        It waits on the process itself, not on `run`: on cancellation `run` is gone first."""
        process = self._process
        if process is None or not self.signal(signal.SIGTERM):
            return
        with anyio.move_on_after(self.policy.stop_timeout_s):
            await process.wait()
        if self.signal(signal.SIGKILL):
            await process.wait()

    async def restart(self) -> None:
        """A planned restart: stop now (or cut the backoff short), start at once; returns
        once the new process runs."""
        self._spawned = anyio.Event()
        self._planned = self.state != "down"
        self._wake.set()
        if self._planned:
            self._set("restarting")
            await self._terminate()
        await self._spawned.wait()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        await self._terminate()
        self._set("stopped")


class Supervisor:
    """Every process of a Procfile, supervised (module docstring)."""

    def __init__(self, specs: Sequence[ProcessSpec], env: Mapping[str, str], *,
                 policy: RestartPolicy | None = None, output: Output | None = None) -> None:
        width = max(len(spec.name) for spec in specs)
        out = output or write_prefixed(width)
        self.policy = policy or RestartPolicy()
        self.children = {spec.name: Child(spec, self.policy, env, out) for spec in specs}
        self._stopping = False

    def child(self, name: str) -> Child:
        if name not in self.children:
            raise SupervisorError(404, f"no process {name!r}; there are {sorted(self.children)}")
        return self.children[name]

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Starts every process in order, then supervises until cancelled or `stop`ped;
        the children are stopped in reverse order on the way out either way."""
        async with anyio.create_task_group() as tg:
            try:
                for child in self.children.values():
                    await tg.start(child.run)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await self.stop()

    async def stop(self) -> None:
        self._stopping = True
        for child in reversed(self.children.values()):
            await child.stop()

    async def kill(self, name: str, signum: int = signal.SIGKILL) -> ProcessStatus:
        child = self.child(name)
        if not child.signal(signum):
            raise SupervisorError(409, f"process {name!r} is not running ({child.state})")
        return child.status()

    async def restart(self, name: str) -> ProcessStatus:
        child = self.child(name)
        await child.restart()
        return child.status()

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(tuple(c.status() for c in self.children.values()),
                                    self._stopping)
