"""glibc's allocator settings: what a launcher adds, large blocks kept off mmap, two arenas."""

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


def run_child(script: str, env: dict[str, str]) -> int:
    """The number `script` prints, run with `env` as its only allocator settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", script], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout)


def test_the_environment_keeps_its_own_settings_and_gets_the_rest() -> None:
    env = allocator_env({"MALLOC_TOP_PAD_": "0", "PATH": "/bin"})
    assert env["MALLOC_TOP_PAD_"] == "0" and env["PATH"] == "/bin"
    assert env["MALLOC_MMAP_THRESHOLD_"] == ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert has_allocator_env(env) and not has_allocator_env({"MALLOC_TOP_PAD_": "0"})


@glibc
def test_large_blocks_come_from_the_heap_not_from_mmap() -> None:
    assert run_child(MAPPED_BLOCKS, dict(ALLOCATOR_ENV)) == 0
    # The pad alone turns glibc's sliding mmap threshold off: once the pad is used up, each
    # block from 128 KiB up is mapped (and unmapped when freed), as a model's activations were.
    assert run_child(MAPPED_BLOCKS, {"MALLOC_TOP_PAD_": ALLOCATOR_ENV["MALLOC_TOP_PAD_"]}) > 0


# Four threads allocate at once; prints how many arenas glibc then has (malloc_info's heaps).
ARENAS = """
import ctypes, os, tempfile, threading
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
together, held = threading.Barrier(4), []
def work():
    together.wait()
    held.append(libc.malloc(1 << 20))
threads = [threading.Thread(target=work) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
path = os.path.join(tempfile.mkdtemp(), "malloc.xml")
out = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, out)
libc.fclose(out)
print(open(path).read().count("<heap nr="))
"""


@glibc
def test_threads_share_one_arena_beside_the_main_one() -> None:
    assert run_child(ARENAS, dict(ALLOCATOR_ENV)) == 2
    # Left alone, glibc gives each thread an arena of its own (each keeping its free memory).
    assert run_child(ARENAS, {}) > 2


# Fills and frees 64 blocks of 2 MiB, then prints the MiB that release_free_memory gave back.
RELEASED = """
import ctypes
from mesh.allocator import release_free_memory
def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) >> 10
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(2 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 2 << 20)
for block in blocks:
    libc.free(block)
before = rss()
assert release_free_memory()
print(before - rss())
"""


@glibc
def test_freed_blocks_stay_until_released() -> None:
    # 128 MiB were freed into the heap; the 64 MiB pad may stay, the rest goes back.
    assert run_child(RELEASED, dict(ALLOCATOR_ENV)) >= 48
