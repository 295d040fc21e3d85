"""What `prepare` did, for the `preprocess` summary and for the cache's `report.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DatasetStats:
    """One `datasets:`/`eval_datasets:` entry: what went in and what became of it."""

    label: str  # path or "passkey"
    type: str
    split: str  # "train" or "eval"
    records: int = 0  # raw records read (pretrain: documents; passkey: samples generated)
    duplicates: int = 0  # identical to an earlier record of the split (dataset_exact_deduplication)
    skipped: int = 0  # nothing to train on (empty text, or a conversation without reply)
    skip_reason: str = "empty text"  # summary of skip_reasons
    skip_reasons: dict[str, int] = field(default_factory=dict)  # reason -> records
    too_long: int = 0  # longer than sequence_len before dropping/truncating
    dropped: int = 0
    truncated: int = 0
    samples: int = 0  # samples that reached packing (pretrain: pieces)
    tokens: int = 0  # tokens in those samples
    target_tokens: int = 0  # labels != -100 in those samples (before packing)
    images: int = 0  # vision runs: images and videos in those samples
    image_tokens: int = 0  # vision runs: tokens standing for their features
    # The first sample as (text, is_target) runs, to show what the model learns from.
    sample: list[tuple[str, bool]] = field(default_factory=list)


@dataclass
class RowStats:
    rows: int = 0
    tokens: int = 0
    target_tokens: int = 0  # labels != -100
    efficiency: float = 0.0  # tokens / (rows * sequence_len)
    # Vision runs: images and videos, the tokens standing for their features, and the most
    # of each in one row (what sizes the vision tower's work on one SP group).
    images: int = 0
    image_tokens: int = 0
    max_images: int = 0
    max_image_tokens: int = 0


@dataclass
class PrepareReport:
    sequence_len: int
    sample_packing: bool
    excess_length_strategy: str
    datasets: list[DatasetStats] = field(default_factory=list)
    train: RowStats = field(default_factory=RowStats)
    eval: RowStats | None = None
    # (low, high, count) with high exclusive; the last bucket holds everything > sequence_len.
    length_histogram: list[tuple[int, int, int]] = field(default_factory=list)
    fingerprint: str = ""
    path: str = ""
    reused: bool = False
    reason: str = ""  # why the cache was (re)built, or "fingerprint matches"
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    prompts: bool = False  # rl: grpo: the rows are prompts to roll out, not packed rows
    vision: bool = False  # processor_type: rows of documents with images and videos
    sequential: bool = False  # sample_packing_sequentially: rows filled in the data's order

    # ---- serialisation (the cache keeps its report so a reuse can print it) -------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrepareReport:
        data = dict(data)
        data["datasets"] = [DatasetStats(**{**d, "sample": [tuple(p) for p in d.get("sample", [])]})
                            for d in data.get("datasets", [])]
        data["train"] = RowStats(**data.get("train", {}))
        data["eval"] = RowStats(**data["eval"]) if data.get("eval") else None
        data["length_histogram"] = [tuple(b) for b in data.get("length_histogram", [])]
        return cls(**data)

    # ---- rendering -----------------------------------------------------------------------
    def render(self) -> Any:
        """A rich renderable: per-dataset table, rows table, length histogram, cache line."""
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = [self._datasets_table(), *self._samples(), self._rows_table()]
        if self.length_histogram:
            parts.append(Text(self.histogram_text()))
        for note in self.notes:
            parts.append(Text(f"note: {note}", style="yellow"))
        parts.append(Text(self.cache_line(), style="bold"))
        return Group(*parts)

    def cache_line(self) -> str:
        if self.reused:
            return f"Reused cache {self.path} (fingerprint {self.fingerprint})."
        return (
            f"Built cache {self.path} (fingerprint {self.fingerprint}) in {self.seconds:.1f}s: "
            f"{self.reason}."
        )

    def _datasets_table(self) -> Any:
        from rich.table import Table

        table = Table(title="Datasets", title_justify="left")
        names = ["split", "dataset", "type", "records", "skipped", "too long", "samples",
                 "tokens", "target tokens"]
        deduplicated = any(d.duplicates for d in self.datasets)
        if deduplicated:
            names.insert(4, "duplicates")
        if self.vision:
            names.append("images (tokens)")
        for name in names:
            table.add_column(name, justify="left" if name in ("split", "dataset", "type")
                             else "right")
        for d in self.datasets:
            skipped = f"{d.skipped:,} ({d.skip_reason})" if d.skipped else "0"
            too_long = "0"
            if d.too_long:
                what = "dropped" if d.dropped else "truncated" if d.truncated else "error"
                too_long = f"{d.too_long:,} {what}"
            cells = [d.split, _short(d.label), d.type, f"{d.records:,}", skipped, too_long,
                     f"{d.samples:,}", f"{d.tokens:,}", f"{d.target_tokens:,}"]
            if deduplicated:
                cells.insert(4, f"{d.duplicates:,} dropped")
            if self.vision:
                cells.append(f"{d.images:,} ({d.image_tokens:,})")
            table.add_row(*cells)
        return table

    def _samples(self) -> list[Any]:
        """One sample per dataset, targets in green and between ⟦ ⟧ (visible without colour)."""
        from rich.text import Text

        out = []
        for d in self.datasets:
            if not d.sample:
                continue
            text = Text(f"Sample of {_short(d.label)} ({d.type}); ⟦targets⟧:\n", style="bold")
            for piece, target in d.sample:
                text.append(f"⟦{piece}⟧" if target else piece,
                            style="green" if target else "dim")
            out.append(text)
        return out

    def _rows_table(self) -> Any:
        from rich.table import Table

        if self.prompts:
            table = Table(title="Prompts, rolled out when drawn", title_justify="left")
            for name in ("split", "prompts", "tokens"):
                table.add_column(name, justify="left" if name == "split" else "right")
            table.add_row("train", f"{self.train.rows:,}", f"{self.train.tokens:,}")
            return table
        mode = ("one sample per row" if not self.sample_packing else
                "packed in order (sequential)" if self.sequential else "packed (FFD)")
        table = Table(title=f"Rows of {self.sequence_len:,} tokens, {mode}", title_justify="left")
        names = ["split", "rows", "tokens", "target tokens", "packing efficiency"]
        if self.vision:
            names += ["images (max/row)", "image tokens (max/row)"]
        for name in names:
            table.add_column(name, justify="left" if name == "split" else "right")
        for split, s in (("train", self.train), ("eval", self.eval)):
            if s is not None:
                cells = [split, f"{s.rows:,}", f"{s.tokens:,}", f"{s.target_tokens:,}",
                         f"{s.efficiency:.1%}"]
                if self.vision:
                    cells += [f"{s.images:,} ({s.max_images:,})",
                              f"{s.image_tokens:,} ({s.max_image_tokens:,})"]
                table.add_row(*cells)
        return table

    def histogram_text(self, width: int = 40) -> str:
        """Sample lengths in tokens (train), one bar per bucket."""
        peak = max((c for _, _, c in self.length_histogram), default=0) or 1
        lines = ["Sample length (tokens, train)"]
        for low, high, count in self.length_histogram:
            label = f"> {low - 1:,}" if high < 0 else f"{low:,}-{high - 1:,}"
            bar = "█" * max(1 if count else 0, round(width * count / peak))
            lines.append(f"  {label:>17} | {bar} {count:,}")
        return "\n".join(lines)

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=110, no_color=True, record=True, file=_Null())
        console.print(self.render())
        return console.export_text()


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _short(label: str, width: int = 40) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def length_histogram(lengths: Any, sequence_len: int, buckets: int = 8) -> list[tuple]:
    """Counts of lengths in `buckets` equal ranges of [1, sequence_len], plus "> sequence_len".

    The overflow bucket is written as (sequence_len + 1, -1, count).
    """
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    step = max(1, -(-sequence_len // buckets))
    out: list[tuple] = []
    for low in range(1, sequence_len + 1, step):
        high = min(low + step, sequence_len + 1)
        out.append((low, high, int(((lengths >= low) & (lengths < high)).sum())))
    over = int((lengths > sequence_len).sum())
    if over:
        out.append((sequence_len + 1, -1, over))
    return out
