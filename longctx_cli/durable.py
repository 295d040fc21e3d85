"""Crash-safe folder writes, shared by the data cache and checkpoints: build in a temporary
folder, flush, write the completeness marker last, rename into place. A leaf module (no
torch), so `data` can use it without importing the training stack."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

# Written last into a finished folder; a folder without it is a crash's leftover.
COMPLETE_MARKER = "COMPLETE"


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename inside it is durable only after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush the written files, so the marker can never reach the disk before the data."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an existing target is moved aside first and removed after."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        if old is not None and not target.exists():
            os.rename(old, target)  # put the previous one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
