"""Resumable checkpoints and the Hugging Face export.

A checkpoint is written into `checkpoint-<step>.tmp/` and renamed to `checkpoint-<step>/`
only after every rank has finished and rank 0 has written the `COMPLETE` marker, so a crash
or kill during a save never leaves a directory that resume would accept.

Before the marker, `MANIFEST.json` records the size and SHA-256 of every file; the marker
holds the manifest's own hash. A file damaged after the save (truncated by a full disk, a
node lost while the file system was still flushing, bit rot) is found on resume and at
`eval`, and `resume_from_checkpoint: auto` falls back to the newest intact checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
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

from longctx_cli.durable import COMPLETE_MARKER, fsync_dir
from longctx_cli.errors import UserError
from longctx_cli.integrity import verify_files, write_manifest
from longctx_cli.runtime.experts import LinearizedExperts, fused_expert_state

try:  # its home module moved between torch releases
    from torch.distributed.checkpoint import CheckpointException
except ImportError:  # pragma: no cover
    from torch.distributed.checkpoint.api import CheckpointException

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    """The checkpoint directory to resume from, or None to start fresh.

    Every candidate is verified against its manifest first (a collective when the process
    group is up: call it on every rank). `auto` skips damaged checkpoints, newest first, and
    says so on rank 0; an explicit path that is damaged is refused.
    """
    if resume_from is None:
        return None
    if resume_from == "auto":
        damaged: list[str] = []
        for _, path in reversed(list_checkpoints(output_dir)):
            problems = verify_files(path)
            if not problems:
                if damaged and _rank() == 0:
                    print(f"warning: skipped damaged checkpoint(s): {'; '.join(damaged)}. "
                          f"Resuming from the newest intact one, {path.name}.",
                          file=sys.stderr, flush=True)
                return path
            damaged.append(f"{path.name} ({problems[0]})")
        if damaged:
            raise UserError(
                f"every checkpoint in {str(output_dir)!r} is damaged: {'; '.join(damaged)}.",
                where="resume_from_checkpoint",
                fix="move the damaged checkpoint-<step> folders away to start afresh (or "
                "restore them from a copy), then run the same command again.",
            )
        return None
    path = Path(resume_from)
    if not (path / COMPLETE_MARKER).is_file():
        raise UserError(
            f"{str(path)!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker).",
            where="resume_from_checkpoint",
            fix="point it at a `checkpoint-<step>` directory, or use `auto` for the newest one.",
        )
    problems = verify_files(path)
    if problems:
        raise UserError(
            f"checkpoint {str(path)!r} is damaged: {'; '.join(problems[:3])}.",
            where="resume_from_checkpoint",
            fix="use `auto` (it takes the newest intact checkpoint) or an older checkpoint.",
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
    """Write `checkpoint-<step>/` atomically; every rank must call this.

    A write that fails (disk full, quota, read-only) removes the partial folder and raises a
    UserError; earlier checkpoints are never touched before the new one is complete.
    """
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp"
    rank = _rank()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "state"))
        torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
        if rank == 0:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
            # The model's config as trained (overrides and RoPE scaling included): what the
            # weights in state/ mean, readable without longctx.
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.config.save_pretrained(tmp)
            _plain_attention_config(tmp)
        _barrier()
        digest = write_manifest(tmp)
        if rank == 0:
            (tmp / COMPLETE_MARKER).write_text(digest)
    except (OSError, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial write took
        raise write_error(f"checkpoint-{step}", output_dir, e) from None
    if rank == 0:
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(output_dir)
        if keep is not None:
            for _, old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _root_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper (the one that names the file)."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def write_error(what: str, output_dir: Path, error: BaseException) -> UserError:
    """The UserError for a save that could not be written, naming what is still intact."""
    cause = _root_cause(error)
    if isinstance(cause, OSError) and cause.strerror:
        detail = f"{cause.strerror} (errno {cause.errno})"
        if cause.filename:
            detail += f" writing {cause.filename}"
    else:
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
    found = list_checkpoints(output_dir)
    kept = (f"the previous checkpoint {found[-1][1].name} and everything else in output_dir "
            "are intact" if found else "nothing else in output_dir was changed")
    return UserError(
        f"could not write {what} in {str(output_dir)!r}: {detail}. Training stopped; the "
        f"partial {what} was removed and {kept}.",
        where="output_dir",
        fix="free space on that disk (or move output_dir to one with room), then run the same "
        "command with `resume_from_checkpoint: auto`.",
    )


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
    full_state = _retie(model, get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    ))
    if _rank() == 0:
        tmp = out.with_name(out.name + ".tmp")
        try:
            _write_export(model, tokenizer, tmp, out, full_state, is_lora, base_model_saver)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(out.name + "/", out.parent, e) from None
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    _barrier()
    return out


def _retie(model: nn.Module, full_state: dict) -> dict:
    """One tensor again under every name of a shared (tied) parameter.

    Gathering FSDP/TP shards yields a separate full tensor per name; `save_pretrained` then
    writes a tied lm_head as if it were its own weight. Sharing the tensor again lets it
    treat the export exactly like a single-process model's.
    """
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in first:
            first[id(param)] = name
        elif name in full_state and first[id(param)] in full_state:
            full_state[name] = full_state[first[id(param)]]
    return full_state


def _write_export(
    model: nn.Module, tokenizer, tmp: Path, out: Path, full_state: dict, is_lora: bool,
    base_model_saver,
) -> None:
    """Write the export into `tmp` (rank 0), with a manifest of its files."""
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
        if any(isinstance(m, LinearizedExperts) for m in base.modules()):
            full_state = fused_expert_state(full_state)  # the model's own layout again
        base.save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
    _plain_attention_config(tmp)
    tokenizer.save_pretrained(tmp)
    write_manifest(tmp, collective=False)


def _point_adapter_at(adapter_dir: Path, base_path: Path) -> None:
    """Make adapter_config.json name the bundled base model (absolute: peft resolves it as is)."""
    cfg_file = adapter_dir / "adapter_config.json"
    data = json.loads(cfg_file.read_text())
    data["base_model_name_or_path"] = str(base_path)
    cfg_file.write_text(json.dumps(data, indent=2))
