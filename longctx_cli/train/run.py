"""`longctx train` on the launcher: the checks of `validate` (`preflight.check_run`), the
output folder, the data cache, then the ranks through the shared torchrun launch. Inside a
rank, however it was started: the same checks (the plan, and where no longctx launcher ran
them, the world around the config), then the loop."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from longctx_cli.config import Config, load_config
from longctx_cli.data.cache import (
    DATA_CACHE_ENV,
    WarmEntry,
    confirm_warm,
    handed_over,
    inputs_key,
    remember_inputs,
    witness,
)
from longctx_cli.errors import UserError
from longctx_cli.launcher.host_memory import fix_mmap_threshold
from longctx_cli.launcher.launch import (
    EarlyTorchrun,
    in_torchrun,
    launched_by_longctx,
    rank_errors,
)
from longctx_cli.launcher.startup import STARTUP_ENV, StartupClock, hide_torchao, needs_torchao
from longctx_cli.launcher.supervise import Supervision, resume_setting, supervise
from longctx_cli.preflight import check_run

# Things a finished or running job leaves in output_dir; their presence means "another run".
RUN_ARTIFACTS = ("metrics.jsonl", "final")

def previous_run_artifacts(output_dir: Path) -> list[Path]:
    if not output_dir.is_dir():
        return []
    found = [output_dir / name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    found += sorted(output_dir.glob("checkpoint-*"))
    return found


def check_output_dir(config: Config, overwrite: bool) -> None:
    """Refuse to train over another run's results unless told to resume or overwrite."""
    output_dir = Path(config.output.output_dir)
    found = previous_run_artifacts(output_dir)
    if not found or resume_setting(config.output.resume_from_checkpoint, output_dir) is not None:
        return  # resuming, told to or after a preemption
    if overwrite:
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
    raise UserError(
        f"output_dir {str(output_dir)!r} already holds another run's results ({names}).",
        where="output_dir",
        fix="set `resume_from_checkpoint: auto` to continue it, pass --overwrite to replace it, "
        "or choose a new `output_dir`.",
    )


def confirm_data_cache(config: Config) -> WarmEntry | None:
    """Build (or reuse) the data cache once, with progress bars, before any rank starts; the
    entry to hand to the ranks, when its inputs could be pinned without the tokenizer.

    A warm cache whose inputs key was recorded is confirmed from the inputs alone (no
    tokenizer, no `datasets`); otherwise `prepare` checks it in full (or builds it) and the
    key is recorded for the next run."""
    warm = confirm_warm(config)
    if warm is not None:
        return warm
    from longctx_cli.data.prepare import prepare

    witness_before = witness(config)  # before the key: a file changed in between shows
    key_before = inputs_key(config)
    prepared = prepare(config)
    path = Path(prepared.path)
    return remember_inputs(config, path, path.name, key_before, witness_before)


def run_train(
    config_path: Path,
    nproc_per_node: int | None,
    nnodes: int | None,
    node_rank: int,
    rdzv_endpoint: str | None,
    overwrite: bool,
    overrides: list[str] | None = None,
    early: EarlyTorchrun | None = None,
) -> int:
    """Entry of `longctx train`; returns the process exit code. `overrides` are `--key value`
    arguments after the config; every rank receives them too. `early`: torchrun's agent,
    started while this launcher checks the run (see `EarlyTorchrun`)."""
    overrides = list(overrides or [])
    clock = StartupClock.of_this_process()
    clock.mark("launcher imports" if not in_torchrun() else "imports")
    config = load_config(config_path, overrides)
    if in_torchrun():
        return _train_on_rank(config, overwrite, overrides, clock)

    _, plan = check_run(config, "train", nproc_per_node, nnodes, overrides=overrides)
    check_output_dir(config, overwrite)
    clock.mark("launcher plan")
    handed = None
    if node_rank == 0 and not config.data.pretraining_dataset:  # streamed data has no cache
        handed = confirm_data_cache(config)
        clock.mark("data cache")
    # The ranks read the entry confirmed here instead of checking the cache again (each
    # verifies the witness first); a value inherited from elsewhere is never passed on.
    os.environ.pop(DATA_CACHE_ENV, None)
    if handed is not None:
        os.environ[DATA_CACHE_ENV] = handed_over(handed)
    os.environ[STARTUP_ENV] = clock.handed_on()  # the ranks go on with this clock
    return supervise(
        ["train", str(config_path), *overrides], plan.world_size, nproc_per_node, nnodes or 1,
        node_rank, rdzv_endpoint, Supervision.of(config), early,
    )


def import_rank_modules(config: Config) -> None:
    """Import what a training rank runs (torch, transformers' model code, the loop): first
    thing in a rank, or ahead of it in a warm process (`launcher.warm_ranks`)."""
    from longctx_cli.train.optim import TORCHAO_OPTIMIZERS

    if not needs_torchao(config, config.training.optimizer in TORCHAO_OPTIMIZERS):
        hide_torchao()  # before the imports below bring in transformers' model code
    import longctx_cli.checks.fidelity  # noqa: F401
    import longctx_cli.runtime.distributed  # noqa: F401
    import longctx_cli.train.loop  # noqa: F401
    import longctx_cli.train.preemption  # noqa: F401


def _train_on_rank(config: Config, overwrite: bool, overrides: list[str],
                   clock: StartupClock) -> int:
    """One rank: the plan for the torchrun world (every rule `validate` applies), then the
    loop. Ranks a user's own torchrun or srun started also check what longctx's launcher
    would have checked first: the world around the config and the output folder."""
    import_rank_modules(config)
    from longctx_cli.checks.fidelity import check_fidelity
    from longctx_cli.runtime.distributed import process_group_released
    from longctx_cli.train.loop import train
    from longctx_cli.train.preemption import Preempted

    rank = int(os.environ.get("RANK", "0"))
    own_launcher = launched_by_longctx()
    try:
        with rank_errors(alike_on_every_rank=True):
            _, plan = check_run(config, "train", overrides=overrides,
                                world_checks=not own_launcher)
            fix_mmap_threshold(config.memory.host_mmap_threshold_mib)  # before the model and data
            if not own_launcher and (rank == 0 or not overwrite):  # rank 0 alone deletes
                check_output_dir(config, overwrite)
            clock.mark("plan")
            # Before any data or weights: refuse a family longctx would not train exactly.
            probe = check_fidelity(config, plan.model.transformers_config())
            clock.mark("fidelity probe")
        with rank_errors(), process_group_released():
            train(config, plan, probe, clock)
    except Preempted as done:
        if rank == 0:
            print(done, flush=True)
        return done.exit_code
    return 0
