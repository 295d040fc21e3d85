"""`host_mmap_threshold_mib` fixes glibc's mmap threshold in each rank
(`launcher/host_memory.py`): a block of a few MiB is then mapped on its own, and given back
when freed, even after a larger block was freed (which, left alone, raises glibc's threshold
and sends such blocks to the heap)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

# In a fresh process: free a 16 MiB block (glibc would now raise its threshold to 16 MiB),
# then take 4 MiB and say how much of it was mapped on its own.
SCRIPT = """
import ctypes, sys
from longctx_cli.launcher.host_memory import fix_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
fixed = fix_mmap_threshold(1 if sys.argv[1] == "fix" else None)
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)
print(fixed, libc.mallinfo2().hblkhd - before)
"""

glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
                           reason="glibc's allocator")


def _run(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env}, check=True).stdout.split()
    return out[0], int(out[1])


@glibc
def test_a_freed_large_block_no_longer_sends_mid_sized_ones_to_the_heap():
    assert _run("default") == ("False", 0)  # glibc alone: carved from the heap
    fixed, mapped = _run("fix")
    assert fixed == "True" and mapped >= 4 << 20


@glibc
def test_a_threshold_the_user_set_is_kept():
    assert _run("fix", MALLOC_MMAP_THRESHOLD_=str(64 << 20)) == ("False", 0)
    assert _run("fix", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=67108864") == ("False", 0)
