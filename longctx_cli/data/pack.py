"""First-fit-decreasing packing of samples into rows of `sequence_len` tokens."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from longctx_cli.constants import IGNORE_INDEX


def ffd_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose total length is at most `capacity`.

    First-fit-decreasing: samples in order of decreasing length (ties: lower index first,
    so the result is deterministic), each into the first bin with room. A segment tree over
    the bins' free space finds that bin in O(log bins), so a million samples pack in seconds.
    Every length must be in [1, capacity].
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    tree = _FreeSpaceTree(len(lengths), capacity)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if not 1 <= n <= capacity:
            raise ValueError(f"sample {i} has length {n}, outside [1, {capacity}]")
        b = tree.first_fit(n)
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree.take(b, n)
    return bins


def sequential_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in their own order, a new bin whenever the next does not fit
    (`sample_packing_sequentially`: keeps the data's order, e.g. a curriculum, at some cost
    in fill). Every length must be in [1, capacity]."""
    bins: list[list[int]] = []
    free = 0
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"sample {i} has length {n}, outside [1, {capacity}]")
        if n > free:
            bins.append([])
            free = capacity
        bins[-1].append(i)
        free -= n
    return bins


class _FreeSpaceTree:
    """Max segment tree over bins' free space; unused bins count as empty (full capacity)."""

    def __init__(self, max_bins: int, capacity: int):
        size = 1
        while size < max(1, max_bins):
            size *= 2
        self.size = size
        self.free = [capacity] * (2 * size)

    def first_fit(self, n: int) -> int:
        """Leftmost bin with at least `n` free tokens (the caller guarantees one exists)."""
        node = 1
        while node < self.size:
            node = 2 * node if self.free[2 * node] >= n else 2 * node + 1
        return node - self.size

    def take(self, b: int, n: int) -> None:
        node = b + self.size
        self.free[node] -= n
        node //= 2
        while node:
            self.free[node] = max(self.free[2 * node], self.free[2 * node + 1])
            node //= 2


def make_row(samples: Iterable[tuple[list[int], list[int], list[int]]]) -> dict[str, list[int]]:
    """Concatenate (input_ids, labels, position_ids) samples into one row.

    The label of every token that starts a document (position 0) becomes -100: it would be
    the target of the previous document's last token, and documents must not learn to
    predict each other.
    """
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for s_ids, s_labels, s_pos in samples:
        ids += s_ids
        labels += s_labels
        pos += s_pos
    for t, p in enumerate(pos):
        if p == 0:
            labels[t] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def packing_efficiency(total_tokens: int, rows: int, sequence_len: int) -> float:
    """Share of the rows' `rows * sequence_len` token slots that hold real tokens."""
    return total_tokens / (rows * sequence_len) if rows else 0.0


def iter_chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
