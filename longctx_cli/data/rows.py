"""The rows of a prepared split as the trainer reads them, without importing `datasets`.

A split in the prepared-data cache is a folder `datasets.Dataset.save_to_disk` wrote: Arrow
stream files and a `state.json` naming them. A rank needs only its rows by index, so it maps
those files with pyarrow (which `datasets` itself reads them with) instead of importing
`datasets` and pandas, about half a second of every rank's start-up. `Rows` offers the part of
`datasets.Dataset` the trainer, evaluation and rollouts use: `len`, `rows[i]`, `rows[column]`,
`select`, iteration and `cache_files`; a split saved with a format or an index mapping (which this
reader would not apply) is refused with None, and the caller reads it with `datasets`.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# What a plain `save_to_disk` of a Dataset without a format or an index mapping records.
_PLAIN_STATE = {"_format_type": None, "_format_columns": None, "_indices_data_files": None}


class Rows:
    """Read-only rows of one saved split (a pyarrow table over its memory-mapped files)."""

    def __init__(self, table: Any, files: list[str]) -> None:
        self._table = table
        self._files = files

    @classmethod
    def read(cls, folder: Path) -> Rows | None:
        """The split saved in `folder`, or None when it is not a plain saved split."""
        import pyarrow as pa

        try:
            state = json.loads((folder / "state.json").read_text())
        except (OSError, ValueError):
            return None
        if any(state.get(k, v) != v for k, v in _PLAIN_STATE.items()) or state.get(
                "_format_kwargs"):
            return None
        files = [str(folder / f["filename"]) for f in state.get("_data_files", [])]
        if not files:
            return None
        tables = [pa.ipc.open_stream(pa.memory_map(f)).read_all() for f in files]
        return cls(pa.concat_tables(tables) if len(tables) > 1 else tables[0], files)

    @property
    def num_rows(self) -> int:
        return self._table.num_rows

    def __len__(self) -> int:
        return self._table.num_rows

    @property
    def column_names(self) -> list[str]:
        return list(self._table.column_names)

    @property
    def cache_files(self) -> list[dict[str, str]]:
        """The files the rows are read from, as `datasets.Dataset.cache_files` lists them."""
        return [{"filename": f} for f in self._files]

    def __getitem__(self, index: int | str) -> Any:
        """Row `index` as a dict, or (a column name) that column as a list."""
        if isinstance(index, str):
            return self._table.column(index).to_pylist()
        if not isinstance(index, int):
            raise TypeError(f"Rows are indexed by row number or column, not {index!r}")
        n = self._table.num_rows
        if not -n <= index < n:
            raise IndexError(f"row {index} of {n}")
        return self._table.slice(index % n, 1).to_pylist()[0]

    def select(self, indices: Sequence[int]) -> Rows:
        """The rows at `indices`, in that order (repeats allowed)."""
        import pyarrow as pa

        # From a buffer: `pa.array` of a Python list first checks for pandas, importing it.
        taken = array("q", indices)
        chosen = pa.Array.from_buffers(pa.int64(), len(taken), [None, pa.py_buffer(taken)])
        return Rows(self._table.take(chosen), self._files)

    @property
    def arrow_table(self) -> Any:
        """The rows as a pyarrow table (to read a large column without Python objects)."""
        return self._table

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._table.to_batches():
            yield from batch.to_pylist()
