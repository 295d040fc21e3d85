"""A vision run's documents and rows: `VisionDocument` (one tokenized record),
first-fit-decreasing packing into `VisionRow`s, and their Arrow layout (prepare's
samples file and the cache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data import pack
from longctx_cli.errors import UserError

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values, as transformers' processors use them


@dataclass
class VisionDocument:
    """One tokenized, image-bearing sample (a whole conversation), ready to pack.

    `pixel_values` and `image_grid_thw` hold the document's images *and* videos in the
    order their placeholders appear (Qwen's vision tower encodes both alike; a video's
    frames are its temporal axis); `media_kinds` says which each grid is, so the model side
    can hand transformers `image_grid_thw` and `video_grid_thw` apart.
    """

    input_ids: list[int]
    labels: list[int]
    mm_token_type_ids: list[int]
    pixel_values: np.ndarray  # [patches, patch_dim] float32
    image_grid_thw: list[tuple[int, int, int]]
    source: str  # "file:line" of the record, for errors
    media_kinds: list[int] = field(default_factory=list)  # per grid: IMAGE or VIDEO
    second_per_grid_ts: list[float] = field(default_factory=list)  # per video, in order

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def image_tokens(self) -> int:
        """Tokens that stand for image or video features (what an image costs in a row)."""
        return sum(1 for t in self.mm_token_type_ids if t != TEXT)

    @property
    def has_targets(self) -> bool:
        """False when no token is trained (the text path skips such records as "no target
        tokens"; the caller decides the same here)."""
        return any(label != IGNORE_INDEX for label in self.labels)


@dataclass
class VisionRow:
    """Packed documents of one training row.

    `position_ids` are the 1-D text positions, restarting at 0 per document: the model side
    reads document boundaries from them and computes mRoPE once per document. Per-document
    lists (`image_counts`, `sources`) are in row order, and each document's grids are
    consecutive in `image_grid_thw`, so grids `[sum(image_counts[:d]), ...)` are document d's.
    """

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    mm_token_type_ids: list[int]
    pixel_values: np.ndarray
    image_grid_thw: list[tuple[int, int, int]]
    media_kinds: list[int]
    second_per_grid_ts: list[float]
    image_counts: list[int]  # grids (images and videos) per document, in row order
    sources: list[str]




def check_fits(doc: VisionDocument, sequence_len: int) -> None:
    """A document longer than a row cannot be trained: it is never split (an image cut
    between rows would lose its features' other half), so say what makes it long."""
    if len(doc) <= sequence_len:
        return
    raise UserError(
        f"this conversation is {len(doc):,} tokens, more than sequence_len {sequence_len:,}; "
        f"{doc.image_tokens:,} of them are image/video tokens for {len(doc.image_grid_thw)} "
        "image(s)/video(s), and a document with images is never split across rows.",
        where=doc.source,
        fix="shrink the images (`image_size`, or a smaller `max_pixels` in the processor's "
        "preprocessor_config.json: fewer patches per image), send fewer frames per video, or "
        "raise `sequence_len`.")


def pack_vision_documents(docs: list[VisionDocument], sequence_len: int) -> list[VisionRow]:
    """Rows of whole documents, first-fit-decreasing (the text packer's `ffd_bins`).

    Each row carries its documents' tokens, positions restarting at 0 per document, and the
    documents' pixels and grids concatenated in the row's document order, so the i-th
    image in the row's tokens is the i-th grid and the i-th block of `pixel_values`.
    """
    for doc in docs:
        check_fits(doc, sequence_len)
    return [vision_row([docs[i] for i in bin_])
            for bin_ in pack.ffd_bins([len(d) for d in docs], sequence_len)]


def vision_row(members: Sequence[VisionDocument]) -> VisionRow:
    """One row of `members`, in that order (`prepare` packs in chunks with this, so its rows
    are exactly `pack_vision_documents`')."""
    row = pack.make_row((d.input_ids, d.labels, list(range(len(d)))) for d in members)
    pixels = [d.pixel_values for d in members if len(d.pixel_values)]
    return VisionRow(
        input_ids=row["input_ids"], labels=row["labels"], position_ids=row["position_ids"],
        mm_token_type_ids=[t for d in members for t in d.mm_token_type_ids],
        pixel_values=(np.concatenate(pixels) if pixels else
                      np.zeros((0, members[0].pixel_values.shape[-1]), dtype=np.float32)),
        image_grid_thw=[g for d in members for g in d.image_grid_thw],
        media_kinds=[k for d in members for k in d.media_kinds],
        second_per_grid_ts=[s for d in members for s in d.second_per_grid_ts],
        image_counts=[len(d.image_grid_thw) for d in members],
        sources=[d.source for d in members])


# The Arrow layout of documents and rows (prepare's samples file and the cache).
# Rows of a vision run hold, besides the text columns, the row's pixel patches flattened
# (`pixel_values`, `pixel_dim` wide), one [t, h, w] grid per image/video in row order, the
# kind of each (1 image, 2 video) and each video's seconds per temporal patch. A whole-image
# processor's image (LLaVA, Gemma 3) is one row of C*H*W values with the grid (0, H, W): no
# patch grid has t = 0, so the trainer reads these back as `[images, C, H, W]`. A positioned
# image (Gemma 4) is its h*w patch rows, row-major, with the grid (-1, h, w): the trainer pads
# them to the row's most and rebuilds each patch's (x, y) from the grid. Which tokens
# are vision tokens is not stored: it is `input_ids == image/video feature token id`, exactly
# what `mm_token_type_ids` was computed from.

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "pixel_values", "pixel_dim",
               "image_grid_thw", "media_kinds", "second_per_grid_ts")
# The intermediate documents keep their vision-token types and source (for errors).
DOC_COLUMNS = ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "pixel_dim",
               "image_grid_thw", "media_kinds", "second_per_grid_ts", "source")


def _arrow_types() -> dict[str, Any]:
    import pyarrow as pa

    return {"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32()),
            "position_ids": pa.list_(pa.int32()), "mm_token_type_ids": pa.list_(pa.int8()),
            "pixel_values": pa.list_(pa.float32()), "pixel_dim": pa.int32(),
            "image_grid_thw": pa.list_(pa.list_(pa.int32())), "media_kinds": pa.list_(pa.int8()),
            "second_per_grid_ts": pa.list_(pa.float32()), "source": pa.string()}


def features(columns: Sequence[str]) -> Any:
    """`datasets.Features` of `columns` (ROW_COLUMNS or DOC_COLUMNS)."""
    from datasets import Features, List, Value

    kinds = {"input_ids": List(Value("int32")), "labels": List(Value("int32")),
             "position_ids": List(Value("int32")), "mm_token_type_ids": List(Value("int8")),
             "pixel_values": List(Value("float32")), "pixel_dim": Value("int32"),
             "image_grid_thw": List(List(Value("int32"))), "media_kinds": List(Value("int8")),
             "second_per_grid_ts": List(Value("float32")), "source": Value("string")}
    return Features({c: kinds[c] for c in columns})


def _pixels_array(blocks: Sequence[np.ndarray]) -> Any:
    """list<float32> of flattened pixel blocks, built from one buffer (no Python floats)."""
    import pyarrow as pa

    sizes = np.array([b.size for b in blocks], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = (np.concatenate([b.reshape(-1) for b in blocks]) if blocks else
            np.zeros(0)).astype(np.float32, copy=False)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat)).cast(
        pa.list_(pa.float32()))


def _table(items: Sequence[VisionDocument | VisionRow], columns: Sequence[str]) -> Any:
    import pyarrow as pa

    types = _arrow_types()
    data = {
        "input_ids": [x.input_ids for x in items], "labels": [x.labels for x in items],
        "position_ids": [getattr(x, "position_ids", None) for x in items],
        "mm_token_type_ids": [x.mm_token_type_ids for x in items],
        "pixel_dim": [int(x.pixel_values.shape[-1]) for x in items],
        "image_grid_thw": [[list(g) for g in x.image_grid_thw] for x in items],
        "media_kinds": [x.media_kinds for x in items],
        "second_per_grid_ts": [x.second_per_grid_ts for x in items],
        "source": [getattr(x, "source", None) for x in items],
    }
    arrays = [_pixels_array([x.pixel_values for x in items]) if c == "pixel_values"
              else pa.array(data[c], type=types[c]) for c in columns]
    return pa.Table.from_arrays(arrays, schema=pa.schema([(c, types[c]) for c in columns]))


def rows_table(rows: Sequence[VisionRow]) -> Any:
    """The cache's columns (ROW_COLUMNS) of `rows`, as a pyarrow Table."""
    return _table(rows, ROW_COLUMNS)


def docs_table(docs: Sequence[VisionDocument]) -> Any:
    """`docs` as prepare's intermediate samples (DOC_COLUMNS), a pyarrow Table."""
    return _table(docs, DOC_COLUMNS)


def docs_from_table(table: Any) -> list[VisionDocument]:
    """The documents of a DOC_COLUMNS table (what `docs_table` wrote)."""
    column = table.column("pixel_values").combine_chunks()
    # `values` and `offsets` index the same child array whatever the list array's own
    # offset (`flatten()` starts at its first value, so it pairs with offsets from 0 only).
    flat = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    dims = table.column("pixel_dim").to_pylist()
    get = {c: table.column(c).to_pylist() for c in DOC_COLUMNS
           if c not in ("pixel_values", "pixel_dim")}
    return [VisionDocument(
        input_ids=get["input_ids"][i], labels=get["labels"][i],
        mm_token_type_ids=get["mm_token_type_ids"][i],
        pixel_values=np.asarray(flat[offsets[i]:offsets[i + 1]], dtype=np.float32
                                ).reshape(-1, dims[i]),
        image_grid_thw=[tuple(g) for g in get["image_grid_thw"][i]],  # type: ignore[misc]
        source=get["source"][i], media_kinds=get["media_kinds"][i],
        second_per_grid_ts=get["second_per_grid_ts"][i]) for i in range(table.num_rows)]
