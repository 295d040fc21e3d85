"""Host memory that freed tensors leave behind: glibc's mmap threshold (`host_mmap_threshold_mib`).

glibc serves a block from its heap unless it is at least the mmap threshold, and it raises
that threshold to the size of every mapped block freed (up to 32 MiB). After the first large
tensor is freed, a CPU rank's activations of a few MiB are carved from the heap, and once
freed they stay resident as fragments the process cannot give back: on `benchmarks/reach.py`'s
16K row, 0.9 GiB of a Ulysses rank's 1.8 GiB peak was freed heap and 0.5 GiB was alive. With
the threshold fixed, every block from that size up is mapped on its own and returned to the
system when freed, so a rank's resident memory follows what is alive; each such block then
costs fresh pages, which is why it is a choice. A threshold the user set in the environment
(`MALLOC_MMAP_THRESHOLD_`, or `GLIBC_TUNABLES`' `glibc.malloc.mmap_threshold`) is left as it
is, and so is every C library but glibc.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameter number for the threshold (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
# The environment variable glibc reads the threshold from at a process's start.
THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


def user_threshold() -> bool:
    """The user chose the threshold in the environment (glibc reads it at start-up)."""
    return THRESHOLD_ENV in os.environ or \
        "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def fix_mmap_threshold(mib: int | None) -> bool:
    """Fix this process's mmap threshold at `mib` MiB (which also stops glibc from raising
    it); whether it was set (not for None, a user's own threshold, or another C library)."""
    if mib is None or user_threshold():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc only: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, mib << 20) == 1
