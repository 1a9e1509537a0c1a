"""glibc's allocator settings: what a launcher adds, and that they keep large blocks off mmap."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from mesh.allocator import ALLOCATOR_ENV, allocator_env, has_allocator_env

# Allocates 64 blocks of 2 MiB (more than the 64 MiB top pad) and prints how many glibc mapped
# with mmap of their own (mallinfo2's hblks) while they were held.
MAPPED_BLOCKS = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
        "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblks
blocks = [libc.malloc(2 << 20) for _ in range(64)]
print(libc.mallinfo2().hblks - before)
for block in blocks:
    libc.free(block)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")


def mapped_blocks(env: dict[str, str]) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", MAPPED_BLOCKS], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout)


def test_the_environment_keeps_its_own_settings_and_gets_the_rest() -> None:
    env = allocator_env({"MALLOC_TOP_PAD_": "0", "PATH": "/bin"})
    assert env["MALLOC_TOP_PAD_"] == "0" and env["PATH"] == "/bin"
    assert env["MALLOC_MMAP_THRESHOLD_"] == ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert has_allocator_env(env) and not has_allocator_env({"MALLOC_TOP_PAD_": "0"})


@glibc
def test_large_blocks_come_from_the_heap_not_from_mmap() -> None:
    assert mapped_blocks(dict(ALLOCATOR_ENV)) == 0
    # The pad alone turns glibc's sliding mmap threshold off: once the pad is used up, each
    # block from 128 KiB up is mapped (and unmapped when freed), as a model's activations were.
    assert mapped_blocks({"MALLOC_TOP_PAD_": ALLOCATOR_ENV["MALLOC_TOP_PAD_"]}) > 0
