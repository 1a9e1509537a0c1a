"""glibc malloc settings for the mesh's processes, given through the environment at start.

glibc reads them once, before a process's first allocation, so a launcher sets them for its
children (`allocator_env`); a process cannot set them for itself. Measured on 2 cores of an AMD
EPYC (docs/engineering-notes.md G3 and G14):

* MALLOC_TOP_PAD_ = 64 MiB: receiving many transient 128 KiB-1 MiB frames made glibc grow and
  trim the heap about once per frame; with the pad the mesh's bulk receive went from 1.0 to
  3.4 GB/s (uvloop) and 0.47 to 3.3 GB/s (trio).
* MALLOC_MMAP_THRESHOLD_ = 32 MiB: setting any of these turns off glibc's sliding mmap
  threshold, which would otherwise rise to the size of the blocks a process frees. With the
  pad alone, every block from 128 KiB up (a model's activations) was a fresh mmap, its pages
  faulted in and unmapped again: a 4K-token prefill ran at 2,100-2,650 tokens/s against
  4,200-4,950 with this setting (32 MiB is the most glibc allows; larger blocks are mapped).
* MALLOC_TRIM_THRESHOLD_ = 128 MiB: the heap keeps up to that much free at its top before
  giving memory back, so a prefill's large temporaries are reused, not trimmed and regrown.

A variable already in the environment wins: `MALLOC_TOP_PAD_=0 make demo` still means zero.
"""

from __future__ import annotations

from collections.abc import Mapping

ALLOCATOR_ENV: Mapping[str, str] = {
    "MALLOC_TOP_PAD_": str(64 << 20),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(128 << 20),
}


def allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with each allocator setting it does not set itself."""
    return {**ALLOCATOR_ENV, **env}


def has_allocator_env(env: Mapping[str, str]) -> bool:
    """Whether `env` sets every allocator variable (to anything: the caller's choice stands)."""
    return all(name in env for name in ALLOCATOR_ENV)
