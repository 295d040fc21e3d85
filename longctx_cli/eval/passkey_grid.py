"""Passkey retrieval over a grid of context lengths x needle depths.

Samples come from the generator training uses (`data/passkey.py`), seeded per cell from a
fixed string, so the eval set is the same on every run and never the stream a training
config draws (those use integer seeds).

Metric (teacher-forced exact match): the row is prompt + answer; a sample is correct when the
argmax prediction at every position that predicts a key token equals that token. Greedy
decoding would emit the same tokens one at a time (each step conditions on the previous key
tokens, which are correct whenever the sample counts as correct), so the two agree; this form
needs a single sequence-parallel forward per sample. The trailing eos is not scored.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data.passkey import EVAL_DEPTHS, PasskeySample, make_passkey_sample
from longctx_cli.errors import UserError
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import gather_sequence, shard_batch
from longctx_cli.runtime.batches import to_device
from longctx_cli.runtime.model import sp_hidden_states

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config import Config

EVAL_SEED = "longctx-eval-passkey"
DEFAULT_KEY_LENGTH = 5


@dataclass(frozen=True)
class GridSpec:
    context_lengths: list[int]
    depths: list[float]
    samples_per_cell: int
    key_length: int

    @property
    def cells(self) -> list[tuple[int, float]]:
        return [(length, depth) for depth in self.depths for length in self.context_lengths]


@dataclass(frozen=True)
class SampleResult:
    context_len: int
    depth: float
    index: int  # sample number within its cell
    key: str
    predicted: str  # the argmax tokens at the key positions, decoded
    correct: bool


@dataclass
class GridResult:
    spec: GridSpec
    samples: list[SampleResult]

    def cell(self, context_len: int, depth: float) -> tuple[int, int]:
        """(correct, total) of one cell."""
        mine = [s for s in self.samples if s.context_len == context_len and s.depth == depth]
        return sum(s.correct for s in mine), len(mine)

    @property
    def accuracy(self) -> float:
        return sum(s.correct for s in self.samples) / max(1, len(self.samples))

    def to_dict(self) -> dict[str, Any]:
        cells = []
        for length, depth in self.spec.cells:
            correct, total = self.cell(length, depth)
            cells.append({"context_len": length, "depth": depth, "correct": correct,
                          "total": total, "accuracy": correct / total if total else None})
        return {"accuracy": self.accuracy, "cells": cells,
                "samples": [asdict(s) for s in self.samples]}


# ---- the grid ------------------------------------------------------------------------------


def _fits(tokenizer: PreTrainedTokenizerBase, context_len: int, key_length: int) -> str | None:
    """None when a sample of `context_len` tokens can be made, else the generator's reason."""
    try:
        make_passkey_sample(tokenizer, context_len, 0.0, key_length, random.Random(0))
    except ValueError as e:
        return str(e)
    return None


def default_lengths(sequence_len: int) -> list[int]:
    """Four lengths doubling up to `sequence_len` (1/8, 1/4, 1/2, 1)."""
    return sorted({max(1, sequence_len // d) for d in (8, 4, 2, 1)})


def key_length_of(config: Config) -> int:
    """The key length training used (first passkey dataset), so eval asks the same question."""
    for entry in [*config.data.datasets, *config.data.eval_datasets]:
        if entry.type == "passkey":
            return entry.key_length
    return DEFAULT_KEY_LENGTH


def grid_spec(config: Config, tokenizer: PreTrainedTokenizerBase) -> GridSpec:
    """The grid from the config, defaults derived from `sequence_len`; checked to be feasible."""
    key_length = key_length_of(config)
    depths = config.eval.eval_depths if config.eval.eval_depths is not None else EVAL_DEPTHS
    bad_depths = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad_depths or not depths:
        raise UserError(f"eval_depths must be a non-empty list of numbers in [0, 1], got {depths}.",
                        where="eval_depths", fix="e.g. `eval_depths: [0.0, 0.5, 1.0]`.")
    if config.eval.eval_context_lengths:
        lengths = sorted(set(config.eval.eval_context_lengths))
        for length in lengths:
            reason = _fits(tokenizer, length, key_length)
            if reason is not None:
                raise UserError(f"{reason}.", where="eval_context_lengths",
                                fix="drop or raise that length.")
    else:
        lengths = [n for n in default_lengths(config.data.sequence_len)
                   if _fits(tokenizer, n, key_length) is None]
        if not lengths:
            reason = _fits(tokenizer, config.data.sequence_len, key_length)
            raise UserError(f"no passkey sample fits in sequence_len: {reason}.",
                            where="eval_context_lengths",
                            fix="set `eval_context_lengths` to lengths that fit.")
    return GridSpec(lengths, list(depths), config.eval.eval_samples_per_cell, key_length)


def cell_samples(
    tokenizer: PreTrainedTokenizerBase, context_len: int, depth: float, spec: GridSpec
) -> list[PasskeySample]:
    """The samples of one cell; a cell's samples do not change when other cells are added."""
    rng = random.Random(f"{EVAL_SEED}/{context_len}/{depth}/{spec.key_length}")
    return [make_passkey_sample(tokenizer, context_len, depth, spec.key_length, rng)
            for _ in range(spec.samples_per_cell)]


# ---- scoring -------------------------------------------------------------------------------


def answer_labels(sample: PasskeySample) -> list[int]:
    """Labels that mark only the key tokens of the answer (the eos after them is not scored)."""
    key_tokens = sample.key_span[1] - sample.key_span[0]
    start = len(sample.prompt_ids)
    labels = [IGNORE_INDEX] * len(sample)
    labels[start : start + key_tokens] = sample.answer_ids[:key_tokens]
    return labels


@torch.no_grad()
def predict_at_labels(
    decoder: nn.Module,
    lm_head: nn.Module,
    input_ids: Sequence[int],
    labels: Sequence[int],
    ctx: ParallelState,
    pad_id: int,
    device: torch.device,
) -> tuple[list[int], list[int]]:
    """(targets, argmax predictions) at every labelled token of one document, in row order.

    One SP forward; lm_head runs only on this rank's labelled positions and only the
    predicted ids travel (an all-gather of one int per token), never `[tokens, vocab]`.
    Every rank of the SP group returns the same lists.
    """
    row = torch.tensor(list(input_ids), dtype=torch.long)
    positions = torch.arange(row.numel())
    batch = to_device(
        shard_batch(row, positions, torch.tensor(list(labels), dtype=torch.long), ctx, pad_id),
        device,
    )
    hidden = sp_hidden_states(decoder, batch, where="--checkpoint")
    targets = batch.shift_labels.reshape(-1)
    scored = targets != IGNORE_INDEX
    predictions = torch.full_like(targets, IGNORE_INDEX)
    if bool(scored.any()):
        predictions[scored] = lm_head(hidden[scored]).argmax(dim=-1)
    all_targets = gather_sequence(targets, ctx).cpu()
    all_predictions = gather_sequence(predictions, ctx).cpu()
    keep = all_targets != IGNORE_INDEX
    return all_targets[keep].tolist(), all_predictions[keep].tolist()


def score_sample(
    decoder: nn.Module,
    lm_head: nn.Module,
    sample: PasskeySample,
    ctx: ParallelState,
    pad_id: int,
    device: torch.device,
) -> tuple[bool, list[int]]:
    """(correct, predicted key token ids) of one passkey sample."""
    targets, predictions = predict_at_labels(
        decoder, lm_head, sample.input_ids, answer_labels(sample), ctx, pad_id, device
    )
    return bool(targets) and targets == predictions, predictions


def run_passkey_grid(
    decoder: nn.Module,
    lm_head: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    spec: GridSpec,
    state: ParallelState,
    pad_id: int,
    show_progress: bool = False,
    label: str = "",
) -> GridResult:
    """Score every cell; data-parallel groups split each cell's samples. Every rank returns
    the full result."""
    ctx, dp_rank, dp_size, device = state, state.dp_rank, state.layout.dp, state.device
    mine: list[SampleResult] = []
    bar = tqdm(spec.cells, desc=f"passkey {label}".strip(), unit="cell",
               disable=None if show_progress else True, dynamic_ncols=True)
    for length, depth in bar:
        samples = cell_samples(tokenizer, length, depth, spec)
        for index in range(dp_rank, len(samples), dp_size):
            sample = samples[index]
            correct, predicted = score_sample(decoder, lm_head, sample, ctx, pad_id, device)
            mine.append(SampleResult(length, depth, index, sample.key,
                                     tokenizer.decode(predicted).strip(), correct))
    bar.close()
    return GridResult(spec, _gather_results(mine, ctx, spec))


def _gather_results(
    mine: list[SampleResult], ctx: ParallelState, spec: GridSpec
) -> list[SampleResult]:
    """Every SP group's results on every rank, in grid order (one copy per SP group)."""
    everything = mine
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[list[SampleResult]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, mine if ctx.sp_rank == 0 else [])
        everything = [s for part in parts for s in part]
    order = {cell: i for i, cell in enumerate(spec.cells)}
    return sorted(everything, key=lambda s: (order[(s.context_len, s.depth)], s.index))
