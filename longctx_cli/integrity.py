"""Size and SHA-256 of every file of a saved folder, recorded at save, checked at load.

Checkpoints (`checkpoint-<step>/`) and the Hugging Face export (`final/`) carry a
`MANIFEST.json`; a checkpoint's `COMPLETE` marker holds the manifest's own hash. Shared by
`train` (writes, verifies on resume) and `eval` (verifies before loading). When a process
group is up, the hashing is split across ranks and everyone gets the same answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from longctx_cli.durable import COMPLETE_MARKER

MANIFEST = "MANIFEST.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _payload_files(root: Path) -> list[str]:
    """Every file under `root` except the manifest and marker, as sorted relative paths."""
    skip = {MANIFEST, COMPLETE_MARKER}
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in skip
    )


def _gather_dicts(mine: dict, collective: bool) -> dict:
    """Merge one dict per rank (each rank did a share of the work)."""
    if not (collective and dist.is_initialized() and _world() > 1):
        return mine
    parts: list = [None] * _world()
    dist.all_gather_object(parts, mine)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def write_manifest(root: Path, collective: bool = True) -> str:
    """Hash every file of `root` (split across ranks when `collective`); rank 0 writes
    MANIFEST.json. Returns the manifest's own SHA-256 (for the marker)."""
    files = _payload_files(root)
    share = files[_rank() :: _world()] if collective else files
    mine = {name: {"size": (root / name).stat().st_size, "sha256": _sha256(root / name)}
            for name in share}
    entries = _gather_dicts(mine, collective)
    text = json.dumps({"version": 1, "files": dict(sorted(entries.items()))}, indent=1)
    if _rank() == 0 or not collective:
        (root / MANIFEST).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def verify_files(root: Path, collective: bool = True) -> list[str]:
    """What is wrong with `root` against its manifest (empty: intact).

    A folder without MANIFEST.json (written before manifests existed, or by another tool)
    is not checked. With `collective`, every rank hashes a share and all get the same answer.
    """
    manifest = root / MANIFEST
    if not manifest.is_file():
        return []
    raw = manifest.read_bytes()
    marker = root / COMPLETE_MARKER
    recorded = marker.read_text().strip() if marker.is_file() else ""
    if recorded and recorded != hashlib.sha256(raw).hexdigest():
        return [f"{MANIFEST} does not match the hash in {COMPLETE_MARKER}"]
    try:
        files: dict = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{MANIFEST} is unreadable"]
    names = sorted(files)
    share = names[_rank() :: _world()] if collective else names
    problems = {}
    for name in share:
        path, want = root / name, files[name]
        if not path.is_file():
            problems[name] = f"{name} is missing"
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems[name] = f"{name} is {size:,} bytes, {want['size']:,} were written"
        elif _sha256(path) != want["sha256"]:
            problems[name] = f"{name} has changed since it was written (checksum mismatch)"
    found = _gather_dicts(problems, collective)
    return [found[k] for k in sorted(found)]
