"""Host memory that freed tensors leave behind: glibc's mmap threshold, fixed.

glibc serves a block from its heap unless it is at least the mmap threshold, and it raises
that threshold to the size of every mmapped block freed (up to 32 MiB). After the first
large tensor is freed, a CPU rank's activations of a few MiB are carved from the heap, and
once freed they stay resident as fragments the process cannot give back: on
`benchmarks/reach.py`'s 16K row, 900 MiB of a Ulysses rank's 1.8 GiB peak was freed heap and
0.5 GiB was alive. With the threshold fixed, every block from `MMAP_THRESHOLD_BYTES` up is
mapped on its own and returned to the system when freed, so a rank's resident memory follows
what is alive. A threshold the user set (`MALLOC_MMAP_THRESHOLD_`, or `GLIBC_TUNABLES`'s
`glibc.malloc.mmap_threshold`) is left as it is, and so is every C library but glibc.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameter number for the threshold (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
# The environment variable glibc reads the threshold from at a process's start.
THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


def user_threshold() -> bool:
    """The user chose the threshold (glibc reads these at start-up)."""
    return THRESHOLD_ENV in os.environ or \
        "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix this process's mmap threshold at `threshold` bytes (which also stops glibc from
    raising it); whether it was set."""
    if user_threshold():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc only: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
