"""`pretraining_dataset`: documents streamed from their files and packed into rows on the fly.

Nothing is materialised: documents are read one at a time through a `datasets` streaming
`IterableDataset`, tokenized, concatenated and cut into rows of exactly `sequence_len` tokens
(positions restart at every document, and at a row start for a continued document, as for
`type: pretrain`). Every rank reads the same stream and takes its own rows of each step.

The position is exact and small: which entry, the `IterableDataset`'s own `state_dict()`
(file and record), the tokens of the current document not yet used, and the pass over the
data. A checkpoint stores it; a resumed run continues with the very next token.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from longctx_cli.data import formats, load, pack
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longctx_cli.config.schema import Config


class PackedStream:
    """Rows of `sequence_len` tokens from `config.data.pretraining_dataset`, in order, forever
    (after the last document of the last entry, the next pass starts again at the first)."""

    def __init__(self, config: Config, tok: PreTrainedTokenizerBase):
        assert config.data.pretraining_dataset
        self.entries = config.data.pretraining_dataset
        self.sources = [load.resolve(e) for e in self.entries]
        self.sequence_len = config.data.sequence_len
        self.tok = tok
        self.state: dict[str, Any] = {"pass": 0, "entry": 0, "stream": None, "records": 0,
                                      "pending": [], "rows": 0}
        self._ds: Any = None
        self._it: Any = None

    # ---- position ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last row returned (JSON-able)."""
        state = copy.deepcopy(self.state)
        if self._ds is not None:
            state["stream"] = copy.deepcopy(self._ds.state_dict())  # it changes as we read
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state)
        self._ds = self._it = None

    # ---- rows --------------------------------------------------------------------------
    def next_rows(self, n: int) -> list[dict[str, list[int]]]:
        """The next `n` rows (`input_ids`, `labels`, `position_ids`)."""
        return [self._row() for _ in range(n)]

    def _row(self) -> dict[str, list[int]]:
        pieces: list[tuple[list[int], list[int], list[int]]] = []
        room = self.sequence_len
        while room:
            if not self.state["pending"]:
                self.state["pending"] = self._next_document()
                continue
            doc = self.state["pending"]
            take, self.state["pending"] = doc[:room], doc[room:]
            pieces.append((take, list(take), list(range(len(take)))))
            room -= len(take)
        self.state["rows"] += 1
        return pack.make_row(pieces)

    def _next_document(self) -> list[int]:
        """Token ids of the next non-empty document, moving to the next entry or pass."""
        empty_passes = 0
        while True:
            if self._it is None:
                self._open()
            try:
                record = next(self._it)
            except StopIteration:
                self._advance_entry()
                if self.state["entry"] == 0:
                    empty_passes += 1
                    if empty_passes > 1:
                        raise UserError("the streamed datasets hold no text.",
                                        where="pretraining_dataset",
                                        fix="check the files and `text_column`.") from None
                continue
            self.state["records"] += 1
            entry = self.entries[self.state["entry"]]
            where = f"{self.sources[self.state['entry']].label}, record {self.state['records']}"
            if entry.field not in record:
                raise UserError(
                    f"has no column {entry.field!r} (columns: {', '.join(record)}).",
                    where=where, fix="set `text_column:` to the column that holds the text.")
            text = formats._text(record[entry.field], entry.field, where)
            if text.strip():
                return formats.encode_document(self.tok, text)

    def _advance_entry(self) -> None:
        self.state["entry"] = (self.state["entry"] + 1) % len(self.entries)
        if self.state["entry"] == 0:
            self.state["pass"] += 1
        self.state["stream"], self.state["records"] = None, 0
        self._ds = self._it = None

    def _open(self) -> None:
        import datasets

        entry, source = self.entries[self.state["entry"]], self.sources[self.state["entry"]]
        try:
            if source.kind == "files":
                ds = datasets.load_dataset(source.builder, data_files=[str(f) for f in
                                                                      source.files],
                                           split="train", streaming=True)
            else:
                ds = datasets.load_dataset(source.label, name=entry.name, split=entry.split,
                                           revision=entry.revision, data_files=entry.data_files,
                                           streaming=True)
        except Exception as exc:  # noqa: BLE001 - any failure to open is the data's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"could not stream it: {first}", where=source.label,
                            fix="check the path, `data_files`, `split` and `name`.") from None
        if self.state["stream"] is not None:
            ds.load_state_dict(self.state["stream"])
        self._ds, self._it = ds, iter(ds)
