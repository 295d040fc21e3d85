"""Rows -> the micro-batches one rank runs: the step's row order, collation, sharding."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from longctx_cli.config import Config
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.parallel.sharding import ShardedBatch, shard_batch
from longctx_cli.runtime.vision import VisionInputs, with_vision

if TYPE_CHECKING:
    from datasets import Dataset

    from longctx_cli.data.rows import Rows


def step_row_indices(
    step: int, steps_per_epoch: int, per_step: int, num_rows: int, seed: int,
    shuffle: bool = True,
) -> list[int]:
    """Global row indices of one optimizer step: a seeded shuffle per epoch (or the rows in
    order: `curriculum_sampling`), then a slice.

    The set of rows in a step depends only on the step, never on how it is split across DP
    ranks and accumulation, so runs with different parallel layouts see the same data.
    """
    epoch, offset = divmod(step, steps_per_epoch)
    window = range(offset * per_step, (offset + 1) * per_step)
    if not shuffle:
        return [i for i in window if i < num_rows]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    return order[window.start : window.stop].tolist()


def collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate micro-batch rows into one row: every row boundary is a document boundary."""
    def cat(key: str) -> torch.Tensor:
        return torch.tensor([t for row in rows for t in row[key]], dtype=torch.long)

    return cat("input_ids"), cat("position_ids"), cat("labels")


def collate_images(rows: Rows | Dataset) -> VisionInputs | None:
    """The images and videos of micro-batch rows, in row order; None for rows without
    vision columns (text runs) and for rows that hold none. The pixels are read from Arrow
    as one array (a long row holds hundreds of millions of them)."""
    if "pixel_values" not in rows.column_names:
        return None
    import numpy as np
    import pyarrow.compute as pc

    table = rows.arrow_table if hasattr(rows, "arrow_table") else rows.data.table
    column = table.column("pixel_values").combine_chunks()
    values = torch.from_numpy(column.flatten().to_numpy(zero_copy_only=False).astype(np.float32))
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    widths = table.column("pixel_dim").to_pylist()
    grids, kinds, seconds, pixels, start = [], [], [], [], 0
    for i, (grid, width) in enumerate(zip(table.column("image_grid_thw").to_pylist(), widths,
                                          strict=True)):
        end = start + int(lengths[i])
        if grid:
            pixels.append(values[start:end].view(-1, width))
            grids += grid
            kinds += table.column("media_kinds")[i].as_py() or [1] * len(grid)
            seconds += table.column("second_per_grid_ts")[i].as_py() or []
        start = end
    if not grids:
        return None
    return media_inputs(torch.cat(pixels), grids, kinds, seconds)


def media_inputs(pixels: torch.Tensor, grids: list, kinds: list[int] | tuple[int, ...],
                 seconds: list[float]) -> VisionInputs:
    """The model side's inputs of stored media (data/vision/tokens.py's layout): patch rows with
    their `[t, h, w]` grids, or, where the grids are `(0, H, W)`, whole images: of one row
    each, `[images, C, H, W]` as LLaVA's tower takes them; or of H*W rows of C channels each
    (Pixtral's, any size), zero-padded to the largest with their `image_sizes`, as its image
    processor pads a batch. (One row per image and H*W rows per image differ for any image
    of more than one pixel.) Where the grids are `(-1, h, w)`, each image's h*w patches
    (Gemma 4's), `[images, patches, patch_dim]` zero-padded to the most, with each patch's
    (x, y), (-1, -1) on padding, as its image processor pads them to its budget. Where they
    are `(-2, aspect ratio id, tiles)`, each image's square tiles padded to one count
    (Mllama's), `[images, tiles, 3, H, W]` with their aspect ratio ids and tile masks."""
    if all(g[0] == -2 for g in grids):  # Mllama: each image's padded tiles, square
        tiles = pixels.shape[0] // len(grids)
        side = math.isqrt(pixels.shape[1] // 3)
        mask = torch.zeros(len(grids), tiles, dtype=torch.long)
        for i, g in enumerate(grids):
            mask[i, :int(g[2])] = 1
        return VisionInputs(pixels.view(len(grids), tiles, 3, side, side),
                            aspect_ratio_ids=torch.tensor([int(g[1]) for g in grids]),
                            tile_mask=mask)
    if all(g[0] == -1 for g in grids):
        sizes = [(int(g[1]), int(g[2])) for g in grids]
        counts = [h * w for h, w in sizes]
        if pixels.shape[0] != sum(counts):
            raise ValueError(f"{pixels.shape[0]} patch rows are not the {sum(counts)} of "
                             f"positioned images {sizes}")
        most = max(counts)
        padded = pixels.new_zeros(len(sizes), most, pixels.shape[1])
        where = torch.full((len(sizes), most, 2), -1, dtype=torch.long)
        for i, (rows, (h, w)) in enumerate(zip(pixels.split(counts), sizes, strict=True)):
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            padded[i, :h * w] = rows
            where[i, :h * w] = torch.stack([xs, ys], -1).reshape(-1, 2)  # patch i: (i%w, i//w)
        return VisionInputs(padded, patch_positions=where)
    if all(g[0] == 0 for g in grids):
        _, height, width = grids[0]
        if pixels.shape[0] == len(grids) and all(tuple(g) == tuple(grids[0]) for g in grids):
            return VisionInputs(pixels.view(len(grids), -1, height, width))
        sizes = [(int(g[1]), int(g[2])) for g in grids]
        if pixels.shape[0] != sum(h * w for h, w in sizes):
            raise ValueError(f"{pixels.shape[0]} pixel rows fit neither one row per image nor "
                             f"one per pixel of images {sizes}")
        top, side = max(h for h, _ in sizes), max(w for _, w in sizes)
        padded = pixels.new_zeros(len(sizes), pixels.shape[1], top, side)
        for i, (rows, (h, w)) in enumerate(zip(pixels.split([h * w for h, w in sizes]), sizes,
                                               strict=True)):
            padded[i, :, :h, :w] = rows.T.reshape(-1, h, w)
        return VisionInputs(padded, image_sizes=torch.tensor(sizes, dtype=torch.long))
    return VisionInputs(pixels, torch.tensor(grids, dtype=torch.long), tuple(kinds),
                        torch.tensor(seconds, dtype=torch.float32) if seconds else None)


def sharded_rows(rows: Rows | Dataset, state: ParallelState, pad_id: int, next_tokens: bool = False,
                 whole_rows: bool = False) -> ShardedBatch:
    """Collated `rows` as this rank's slice; a vision-language row also carries its whole
    row's ids, text positions and images (runtime/vision.py). `whole_rows`: each row is one
    input row of the model's own training (`ObjectiveSection.whole_rows`), so its start is
    recorded (`SPMeta.row_starts`)."""
    listed = list(rows)  # read once
    ids, positions, labels = collate(listed)
    starts = None
    if whole_rows:
        ends = torch.tensor([len(row["input_ids"]) for row in listed]).cumsum(0).tolist()
        starts = (0, *ends[:-1])
    sharded = shard_batch(ids, positions, labels, state, pad_id, next_tokens=next_tokens,
                          row_starts=starts)
    if "pixel_values" in rows.column_names:
        sharded = with_vision(sharded, ids, positions, collate_images(rows), pad_id)
    return sharded


def micro_batches(rows, indices: list[int], config: Config, state: ParallelState,
                  pad_id: int) -> list[ShardedBatch]:
    """This DP rank's micro-batches of one step, sharded for this SP rank."""
    mbs, ga = config.training.micro_batch_size, config.training.gradient_accumulation_steps
    mine = indices[state.dp_rank * mbs * ga : (state.dp_rank + 1) * mbs * ga]
    batches = []
    for i in range(ga):
        chosen = mine[i * mbs : (i + 1) * mbs]
        sharded = sharded_rows(rows.select(chosen), state, pad_id, config.objective.rl == "orpo",
                               config.objective.whole_rows)
        batches.append(to_device(replace(sharded, rows=tuple(chosen)), state.device))
    return batches


def row_batch(rows, index: int, state: ParallelState, pad_id: int,
              next_tokens: bool = False, whole_rows: bool = False) -> ShardedBatch:
    """Row `index` alone, sharded for this rank and on its device (evaluation, reference
    passes): `rows` records which row it is. `whole_rows`: as `sharded_rows`."""
    sharded = sharded_rows(rows.select([index]), state, pad_id, next_tokens, whole_rows)
    return to_device(replace(sharded, rows=(index,)), state.device)


def to_device(batch: ShardedBatch, device: torch.device) -> ShardedBatch:
    """A copy of `batch` on `device`; the input batch (and its meta) is left as it was."""
    if device.type == "cpu":
        return batch
    # The meta's cache dict is shared, not copied: nothing has filled it yet.
    meta = replace(batch.sp_meta, cu_seqlens=batch.sp_meta.cu_seqlens.to(device))
    return replace(
        batch,
        input_ids=batch.input_ids.to(device),
        position_ids=batch.position_ids.to(device),
        shift_labels=batch.shift_labels.to(device),
        sp_meta=meta,
        next_tokens=None if batch.next_tokens is None else batch.next_tokens.to(device),
    )
