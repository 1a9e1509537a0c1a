"""The lifeline between a launcher and its children: a child dies with the launcher.

A `prfaas serve` whose launcher (`prfaas up`, `prfaas chaos`, a test's `launch`) was killed
with SIGKILL has no one left to stop it: it keeps its ports and hundreds of MiB, and the next
demo or test run finds its ports taken. A launcher puts its pid in the children's environment
(`child_env`); each child asks Linux to send it SIGTERM when that parent dies
(`prctl(PR_SET_PDEATHSIG)`), and exits at once if the parent is already gone. Elsewhere
(macOS) the lifeline is a no-op and a killed launcher still leaves its children behind.

Linux ties the signal to the parent *thread* that forked: launchers spawn from their event
loop's thread (asyncio and uvloop do; trio's open_process forks from a worker thread and
must not be used for children that call `die_with_parent`) or the main thread (`launch`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_ENV = "PRFAAS_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child that should die with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with `child_env`: SIGTERM to this process when the parent dies."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("cannot tie this process to its parent: %s", os.strerror(ctypes.get_errno()))
        return
    # The parent may have died before the prctl: then nobody will send the signal.
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
