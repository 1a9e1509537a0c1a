"""The CPU time a process has used: how the benchmarks and tests see what a service costs
apart from how busy the machine is (a loaded host stretches wall time, not CPU time).

Linux only: user + system time from /proc/PID/stat, in the kernel's clock ticks.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far; OSError once it has ended."""
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
