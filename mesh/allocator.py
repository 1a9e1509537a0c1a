"""glibc malloc settings for the mesh's processes, given through the environment at start.

glibc reads them once, before a process's first allocation, so a launcher sets them for its
children (`allocator_env`); a process cannot set them for itself (the measurements behind
each: docs/engineering-notes.md G3, G14 and 3d):

* MALLOC_TOP_PAD_ = 64 MiB: receiving many transient 128 KiB-1 MiB frames made glibc grow and
  trim the heap about once per frame.
* MALLOC_MMAP_THRESHOLD_ = 32 MiB: setting any of these turns off glibc's sliding mmap
  threshold, which would otherwise rise to the size of the blocks a process frees. With the
  pad alone, every block from 128 KiB up (a model's activations) was a fresh mmap, its pages
  faulted in and unmapped again (32 MiB is the most glibc allows; larger blocks are mapped).
* MALLOC_ARENA_MAX = 2: the loop's thread allocates from the main arena and every other thread
  (model compute, tokenizing) shares one more. glibc gives each thread an arena of its own up
  to 8 per core, and with blocks up to 32 MiB kept in them each arena held its own free memory.

Blocks up to 32 MiB now stay in the heap when freed, so a process keeps the peak of its work
(a prefill of a long prompt) until it calls `release_free_memory` (glibc's `malloc_trim`),
which the prefill worker does when it goes idle.

A variable already in the environment wins: `MALLOC_TOP_PAD_=0 make demo` still means zero.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Mapping

ALLOCATOR_ENV: Mapping[str, str] = {
    "MALLOC_TOP_PAD_": str(64 << 20),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_ARENA_MAX": "2",
}


def allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with each allocator setting it does not set itself."""
    return {**ALLOCATOR_ENV, **env}


def has_allocator_env(env: Mapping[str, str]) -> bool:
    """Whether `env` sets every allocator variable (to anything: the caller's choice stands)."""
    return all(name in env for name in ALLOCATOR_ENV)


def release_free_memory() -> bool:
    """Hands the free pages of every glibc arena back to the system (`malloc_trim(0)`); blocks
    the calling thread for a few milliseconds. False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(None).malloc_trim(0)
    return True
