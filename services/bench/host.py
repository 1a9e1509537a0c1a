"""The machine a measurement was taken on, in words: every benchmark, profile and report that
claims a time names its CPU and how busy the machine was, from here.

Speed on these hosts is only comparable within one run (the host changes between sessions:
AMD with and without AVX512-BF16, Intel with AMX), so a figure without its CPU and load
average is not worth keeping.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

# Vector extensions that tell CPU generations apart where a VM's model name does not
# ("Intel(R) Xeon(R) Processor"): AMX on Sapphire Rapids and later.
FEATURES = ("amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it, with its widest vector extensions in
    brackets (the platform's words where there is no /proc/cpuinfo)."""
    try:
        info = cpuinfo.read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info
                 if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info
                  if line.startswith("flags")), [])
    return f"{name} [{' '.join(f for f in FEATURES if f in flags)}]"


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none): what else was running."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def machine_line(torch_threads: int | None = None) -> str:
    """One line for a report: host, CPU, logical CPUs and, for a model measurement, torch's
    threads and version."""
    line = f"host {platform.node()}: {cpu_name()}, {os.cpu_count()} logical CPUs"
    if torch_threads is not None:
        import torch  # only a model measurement pays for the import

        line += f", {torch_threads} torch thread(s), torch {torch.__version__}"
    return line
