"""services.cli.lifeline: a child started with child_env dies when its launcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.cli.lifeline import PARENT_ENV, child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

CHILD = "from services.cli.lifeline import die_with_parent; {call}; import time; time.sleep(60)"
# The launcher starts the child (tied to it or not), prints its pid, then waits to be killed.
LAUNCHER = """
import subprocess, sys, time, os
from services.cli.lifeline import child_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(os.environ))
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _orphan_after_launcher_killed(call: str) -> tuple[int, bool]:
    """Kills the launcher; whether its child is still alive 5 s later (then stops it)."""
    with subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD.format(call=call)],
                          stdout=subprocess.PIPE, text=True) as launcher:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        time.sleep(1.0)  # the child has imported and made its prctl call
        launcher.kill()
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    return pid, alive


def test_a_child_tied_by_die_with_parent_goes_when_its_launcher_is_killed() -> None:
    _, alive = _orphan_after_launcher_killed("die_with_parent()")
    assert not alive


def test_without_the_lifeline_the_child_would_be_left_behind() -> None:
    # The control: the same launcher and child without the call leaves an orphan.
    _, alive = _orphan_after_launcher_killed("None")
    assert alive


def test_child_env_names_this_process() -> None:
    assert child_env({"A": "1"}) == {"A": "1", PARENT_ENV: str(os.getpid())}
