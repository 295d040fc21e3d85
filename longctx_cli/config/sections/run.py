"""The run section: how a run guards itself (restarts, hang and collective timeouts,
preemption, the fidelity probe) and how strictly its keys are read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from longctx_cli.config.sections.base import Section


class RunSection(Section):
    title = "output"

    strict: bool | None = Field(
        None,
        description="How unknown keys are read. Unset: a key that is neither longctx's nor "
        "one of the Axolotl keys docs/axolotl.md lists is an error; `false`: it is listed in "
        "the plan as ignored (a near typo of a known key stays an error); `true`: as unset, "
        "and command-line overrides may only replace keys the file already has.",
    )
    collective_timeout_s: int = Field(
        300,
        ge=10,
        description="Seconds a collective may wait before the job is declared hung and stopped.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Restart the worker group this many times after a rank dies or hangs; the "
        "new workers resume from the newest intact checkpoint. A fault that repeats at the "
        "same step, or a user error (config, data, NaN), is not retried.",
    )
    step_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A worker group that finishes no optimizer step for this long (a stuck "
        "collective, a stopped rank) is stopped, the stuck rank named; restarted if "
        "`max_restarts` allows. Unset: no limit.",
    )
    preemption_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = Field(
        ["SIGTERM", "SIGUSR1"],
        description="Signals (to the launcher or any rank) that make every rank finish the "
        "current optimizer step, write a checkpoint and exit with status 75 (preempted, "
        "resumable). SLURM: `#SBATCH --signal=USR1@120`.",
    )
    preemption_grace_s: int = Field(
        600,
        ge=1,
        description="How long the launcher lets the ranks finish their step and save after a "
        "preemption signal before it kills them (torchrun's shutdown timeout).",
    )
    fidelity_probe: bool = Field(
        True,
        description="Before training (and in `validate`), check on a tiny random model of the "
        "same family that longctx computes exactly the model's own loss and gradients; refuse "
        "to train on any difference. `false` skips the check (docs/families.md).",
    )
