"""RULER's synthetic tasks in `longctx eval`, scored by greedy generation under SP.

Each sample (`data/ruler.py`: exact token length, seeded, identical on every run) is
prefilled sequence-parallel and its answer decoded greedily from the sharded KV cache
(`eval/generate.py`), up to the task's answer budget; the decoded text is scored with RULER's
string match (`all`: the share of gold strings found, `part`: any found). Data-parallel
groups split each (task, length) cell's samples; every rank returns the full result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from tqdm.auto import tqdm

from longctx_cli.data.ruler import TASKS, make_sample, min_length, ruler_average, score
from longctx_cli.errors import UserError
from longctx_cli.runtime.sampling import greedy_tokens

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config import Config
    from longctx_cli.parallel.mesh import ParallelState

RULER_SEED = 0  # not the training seed: the eval set is the same for every run
EVAL_TASK_GROUPS = {"ruler": tuple(TASKS)}  # shorthands `eval_tasks` accepts
OTHER_TASKS = ("passkey", "position_loss")  # the teacher-forced evaluations


@dataclass(frozen=True)
class RulerSpec:
    tasks: list[str]
    lengths: list[int]
    samples: int

    @property
    def cells(self) -> list[tuple[str, int]]:
        return [(task, length) for task in self.tasks for length in self.lengths]


@dataclass(frozen=True)
class RulerSampleResult:
    task: str
    length: int
    index: int
    answers: list[str]
    prediction: str
    score: float


@dataclass
class RulerResult:
    spec: RulerSpec
    samples: list[RulerSampleResult]

    def score(self, task: str, length: int) -> float | None:
        mine = [s.score for s in self.samples if s.task == task and s.length == length]
        return sum(mine) / len(mine) if mine else None

    def average(self, length: int | None = None) -> float:
        """RULER's average: the mean over tasks (of one length, or of every length)."""
        lengths = self.spec.lengths if length is None else [length]
        per_task = {}
        for task in self.spec.tasks:
            values = [v for n in lengths if (v := self.score(task, n)) is not None]
            per_task[task] = sum(values) / len(values) if values else 0.0
        return ruler_average(per_task)

    def to_dict(self) -> dict[str, Any]:
        return {
            "average": self.average(),
            "average_by_length": {str(n): self.average(n) for n in self.spec.lengths},
            "cells": [{"task": t, "length": n, "score": self.score(t, n)}
                      for t, n in self.spec.cells],
            "samples": [asdict(s) for s in self.samples],
        }


def expand_tasks(names: list[str]) -> tuple[list[str], list[str]]:
    """(teacher-forced evaluations, RULER tasks) of `eval_tasks`, shorthands expanded, in
    order, without repeats; an unknown name is a UserError listing the known ones."""
    others: list[str] = []
    ruler: list[str] = []
    for name in names:
        if name in OTHER_TASKS:
            others += [name] if name not in others else []
        elif name in TASKS or name in EVAL_TASK_GROUPS:
            for task in EVAL_TASK_GROUPS.get(name, (name,)):
                ruler += [task] if task not in ruler else []
        else:
            known = ", ".join([*OTHER_TASKS, *EVAL_TASK_GROUPS, *TASKS])
            raise UserError(f"unknown evaluation task {name!r}.", where="eval_tasks",
                            fix=f"use any of: {known}.")
    return others, ruler


def ruler_spec(config: Config, tokenizer: PreTrainedTokenizerBase, tasks: list[str],
               default_lengths: list[int], max_positions: int | None) -> RulerSpec:
    """The tasks at `eval_context_lengths` (or the default lengths a task can fill), checked
    before any rank starts: a length too short for a task, or beyond the model's positions."""
    explicit = config.eval.eval_context_lengths
    lengths = sorted(set(explicit or default_lengths))
    if max_positions and lengths[-1] > max_positions:
        raise UserError(
            f"evaluation length {lengths[-1]:,} is beyond the model's max_position_embeddings "
            f"({max_positions:,}): positions past it were never trained, and RoPE models "
            "extrapolate poorly there unless their rotary embedding is scaled.",
            where="eval_context_lengths",
            fix="evaluate up to max_position_embeddings, or scale RoPE for longer contexts "
            "(`overrides_of_model_config: {rope_scaling: ...}` or a larger `rope_theta`) and "
            "train at those lengths first.")
    if lengths[-1] > config.data.sequence_len:
        raise UserError(
            f"evaluation length {lengths[-1]:,} is beyond `sequence_len` = "
            f"{config.data.sequence_len:,}, what the plan budgets memory for.",
            where="eval_context_lengths",
            fix="raise `sequence_len` (and `sequence_parallel_degree`) or drop that length.")
    shortest = {task: min_length(task, tokenizer) for task in tasks}
    too_short = [(t, n) for t in tasks for n in lengths if n < shortest[t]]
    if too_short and explicit:
        task, length = too_short[0]
        raise UserError(
            f"RULER task {task!r} needs at least {shortest[task]:,} tokens with this "
            f"tokenizer; `eval_context_lengths` has {length:,}.",
            where="eval_context_lengths",
            fix=f"use lengths of at least {max(shortest.values()):,} for these tasks, or drop "
            f"{task!r} from `eval_tasks`.")
    lengths = [n for n in lengths if all(n >= shortest[t] for t in tasks)]
    if not lengths:
        raise UserError(
            f"no default evaluation length fits RULER's tasks (they need up to "
            f"{max(shortest.values()):,} tokens; sequence_len is {config.data.sequence_len:,}).",
            where="eval_context_lengths",
            fix="set `eval_context_lengths` (and `sequence_len`) to longer lengths.")
    return RulerSpec(tasks, lengths, config.eval.eval_ruler_samples)


def run_ruler(
    decoder: nn.Module,
    lm_head: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    spec: RulerSpec,
    state: ParallelState,
    pad_id: int,
    show_progress: bool = False,
    label: str = "",
) -> RulerResult:
    """Generate and score every sample (collective: every rank of the world calls)."""
    mine: list[RulerSampleResult] = []
    bar = tqdm(spec.cells, desc=f"RULER {label}".strip(), unit="cell",
               disable=None if show_progress else True, dynamic_ncols=True)
    for task, length in bar:
        budget = TASKS[task].max_new_tokens
        for index in range(state.dp_rank, spec.samples, state.layout.dp):
            sample = make_sample(task, tokenizer, length, index, RULER_SEED)
            new = greedy_tokens(decoder, lm_head, sample.prompt_ids, budget, state, pad_id,
                                state.device, tokenizer.eos_token_id)
            text = tokenizer.decode(new, skip_special_tokens=True)
            mine.append(RulerSampleResult(task, length, index, list(sample.answers), text,
                                          score(task, text, list(sample.answers))))
    bar.close()
    everything = mine
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[list[RulerSampleResult]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, mine if state.sp_rank == 0 else [])
        everything = [s for part in parts for s in part]
    order = {cell: i for i, cell in enumerate(spec.cells)}
    everything.sort(key=lambda s: (order[(s.task, s.length)], s.index))
    return RulerResult(spec, everything)
