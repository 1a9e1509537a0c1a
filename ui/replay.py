"""Recorded event logs: read, write, list, and play back into the hub with their timing.

A log is JSON lines, one telemetry event a line (`services.contract.events.encode_json`), so a run
recorded anywhere (live mesh, sim, the synthetic demo) can be watched later. Playback keeps the
gaps between events' timestamps, divided by the speed; pause and speed changes take effect
within `max_step_s` of wall time. The sleep is injected so tests run on trio's virtual clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import anyio
import msgspec
from anyio.abc import TaskGroup

from services.contract.events import AnyEvent, decode_json
from ui.errors import ReplayError
from ui.hub import EventHub

Sleep = Callable[[float], Awaitable[None]]
MAX_SPEED = 1000.0
PACKAGED_REPLAYS = Path(__file__).parent / "replays"


class LogInfo(msgspec.Struct, frozen=True):
    name: str
    size_bytes: int


class ReplayStatus(msgspec.Struct, frozen=True):
    """Where the current (or last) replay stands."""

    name: str | None
    state: Literal["idle", "playing", "paused", "finished"]
    speed: float
    position_s: float  # log time played so far
    duration_s: float
    events: int
    published: int


def read_log(path: Path) -> list[AnyEvent]:
    """Every event of a JSON-lines log; ReplayError names the file and the bad line."""
    events: list[AnyEvent] = []
    try:
        with path.open("rb") as file:
            for number, line in enumerate(file, 1):
                if line.strip():
                    events.append(_decode_line(path, number, line))
    except OSError as exc:
        raise ReplayError(f"cannot read event log {str(path)!r}: {exc}", 404) from exc
    return events


def _decode_line(path: Path, number: int, line: bytes) -> AnyEvent:
    try:
        return decode_json(line)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ReplayError(f"{path.name} line {number}: {exc}") from exc


def find_logs(dirs: Sequence[Path]) -> dict[str, Path]:
    """`*.jsonl` files in `dirs` by file name; an earlier directory wins a name clash."""
    logs: dict[str, Path] = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.jsonl")):
            logs.setdefault(path.name, path)
    return logs


def check_speed(speed: float) -> float:
    if not 0 < speed <= MAX_SPEED:
        raise ReplayError(f"speed must be within (0, {MAX_SPEED:g}], got {speed!r}")
    return float(speed)


class ReplayControl:
    """Speed, pause and position of one playback; shared by the player and its controllers."""

    def __init__(self, speed: float = 1.0) -> None:
        self.speed = check_speed(speed)
        self.position_s = 0.0
        self.published = 0
        self.paused = False
        # Created on first wait, inside the event loop (anyio events need a running backend).
        self._resumed: anyio.Event | None = None

    def set_speed(self, speed: float) -> None:
        self.speed = check_speed(speed)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    async def wait_playing(self) -> None:
        while self.paused:
            if self._resumed is None:
                self._resumed = anyio.Event()
            await self._resumed.wait()


async def _play_until(
    target_s: float, control: ReplayControl, sleep: Sleep, max_step_s: float
) -> None:
    while control.position_s < target_s:
        await control.wait_playing()
        step = min(target_s - control.position_s, max_step_s * control.speed)
        await sleep(step / control.speed)
        control.position_s += step


async def run_replay(
    log: Path | Sequence[AnyEvent],
    hub: EventHub,
    speed: float = 1.0,
    *,
    control: ReplayControl | None = None,
    sleep: Sleep = anyio.sleep,
    max_step_s: float = 0.25,
) -> int:
    """Plays a log into `hub` (which a replay must own) with its timing; returns events played."""
    events = read_log(log) if isinstance(log, Path) else log
    control = control if control is not None else ReplayControl(speed)
    if not events:
        return 0
    start = events[0].ts
    for event in events:
        await _play_until(event.ts - start, control, sleep, max_step_s)
        hub.publish_replayed(event)
        control.published += 1
    return control.published


class ReplayRunner:
    """The dashboard's one replay at a time: started, paused, re-speeded, stopped over HTTP."""

    def __init__(self, hub: EventHub, dirs: Sequence[Path], sleep: Sleep = anyio.sleep) -> None:
        self._hub = hub
        self._dirs = list(dirs)
        self._sleep = sleep
        self._tasks: TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self._control = ReplayControl()
        self._name: str | None = None
        self._events: Sequence[AnyEvent] = ()
        self._finished = False

    def attach(self, tasks: TaskGroup) -> None:
        """The task group replays run in (the app's lifespan owns it)."""
        self._tasks = tasks

    def logs(self) -> list[LogInfo]:
        return [LogInfo(name, path.stat().st_size) for name, path in find_logs(self._dirs).items()]

    async def play(self, name: str, speed: float = 1.0) -> ReplayStatus:
        """Stops any replay, then plays log `name` from its start into a fresh dashboard."""
        path = find_logs(self._dirs).get(name)
        if path is None:
            raise ReplayError(f"no event log named {name!r}", 404)
        control = ReplayControl(speed)
        events = await anyio.to_thread.run_sync(read_log, path)
        if self._tasks is None:
            raise ReplayError("the replay runner is not attached to a running app", 503)
        self._cancel()
        self._hub.reset("replay")
        self._name, self._events, self._control, self._finished = name, events, control, False
        self._scope = anyio.CancelScope()
        self._tasks.start_soon(self._run, self._scope, events, control)
        return self.status()

    async def _run(
        self, scope: anyio.CancelScope, events: Sequence[AnyEvent], control: ReplayControl
    ) -> None:
        with scope:
            await run_replay(events, self._hub, control=control, sleep=self._sleep)
            self._finished = True

    def pause(self) -> ReplayStatus:
        self._control.pause()
        return self.status()

    def resume(self) -> ReplayStatus:
        self._control.resume()
        return self.status()

    def set_speed(self, speed: float) -> ReplayStatus:
        self._control.set_speed(speed)
        return self.status()

    def stop(self) -> ReplayStatus:
        """Ends the replay and goes back to the live feed."""
        self._cancel()
        self._name, self._events, self._finished = None, (), False
        self._hub.reset("live")
        return self.status()

    def _cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None

    def status(self) -> ReplayStatus:
        control = self._control
        state: Literal["idle", "playing", "paused", "finished"]
        if self._name is None:
            state = "idle"
        elif self._finished:
            state = "finished"
        else:
            state = "paused" if control.paused else "playing"
        events = self._events
        duration = events[-1].ts - events[0].ts if events else 0.0
        return ReplayStatus(
            self._name,
            state,
            control.speed,
            control.position_s,
            duration,
            len(events),
            control.published,
        )
