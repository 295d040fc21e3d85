"""Resumable checkpoints and the Hugging Face export.

A checkpoint is written into `checkpoint-<step>.tmp/` and renamed to `checkpoint-<step>/`
only after every rank has finished and rank 0 has written the `COMPLETE` marker, so a crash
or kill during a save never leaves a directory that resume would accept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from longctx_cli.errors import UserError

COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir`, oldest first."""
    found = []
    if output_dir.is_dir():
        for child in output_dir.iterdir():
            match = _CHECKPOINT_RE.match(child.name)
            if match and (child / COMPLETE_MARKER).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_resume(resume_from: str | None, output_dir: Path) -> Path | None:
    """The checkpoint directory to resume from, or None to start fresh."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume_from)
    if not (path / COMPLETE_MARKER).is_file():
        raise UserError(
            f"{str(path)!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker).",
            where="resume_from_checkpoint",
            fix="point it at a `checkpoint-<step>` directory, or use `auto` for the newest one.",
        )
    return path


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict,
    keep: int | None = None,
) -> Path:
    """Write `checkpoint-<step>/` atomically; every rank must call this."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "state"))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    _barrier()
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
        (tmp / COMPLETE_MARKER).write_text("")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        if keep is not None:
            for _, old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler
) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path / "state"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / TRAINER_STATE).read_text())


def _plain_attention_config(directory: Path) -> None:
    """Saved configs name the SP attention; a plain transformers user has not registered it."""
    config_file = directory / "config.json"
    if config_file.is_file():
        data = json.loads(config_file.read_text())
        if "attn_implementation" in data or "_attn_implementation" in data:
            data.pop("_attn_implementation", None)
            data.pop("attn_implementation", None)
            config_file.write_text(json.dumps(data, indent=2))


def export_final(
    model: nn.Module, tokenizer, out: Path, is_lora: bool, base_model_saver=None
) -> Path:
    """Write `out/` in Hugging Face format (full model or LoRA adapter) plus the tokenizer.

    Every rank must call this (gathering FSDP shards is collective); rank 0 writes.
    `base_model_saver(dir)`, when given for a LoRA run, saves the frozen base model next to
    the adapter (needed when the base was randomly initialised and exists nowhere else).
    """
    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() == 0:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if is_lora:
            if base_model_saver is not None:
                base_dir = tmp / "base_model"
                base_model_saver(base_dir)
                _plain_attention_config(base_dir)
            model.save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
            if base_model_saver is not None:
                _point_adapter_at(tmp, (out / "base_model").resolve())
        else:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
        _plain_attention_config(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    _barrier()
    return out


def _point_adapter_at(adapter_dir: Path, base_path: Path) -> None:
    """Make adapter_config.json name the bundled base model (absolute: peft resolves it as is)."""
    cfg_file = adapter_dir / "adapter_config.json"
    data = json.loads(cfg_file.read_text())
    data["base_model_name_or_path"] = str(base_path)
    cfg_file.write_text(json.dumps(data, indent=2))
