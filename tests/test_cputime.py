"""mesh.cputime: a process's CPU time, which grows with work and not with waiting."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mesh.cputime import cpu_seconds


def test_cpu_time_grows_with_work_not_with_sleep() -> None:
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    worked = cpu_seconds(os.getpid()) - before
    time.sleep(0.3)
    slept = cpu_seconds(os.getpid()) - before - worked
    assert 0.2 <= worked <= 0.5
    assert slept < 0.1


def test_a_process_that_ended_raises() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError):
        cpu_seconds(child.pid)
