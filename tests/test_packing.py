"""Packing invariants: FFD bins and the rows built from them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx_cli.constants import IGNORE_INDEX as IGNORE
from longctx_cli.data.pack import ffd_bins, make_row, packing_efficiency


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 64).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=60))))
def test_ffd_keeps_every_sample_once_and_respects_capacity(case):
    capacity, lengths = case
    bins = ffd_bins(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert all(b for b in bins)
    # Any first-fit packing has at most one bin that is half empty or worse.
    assert sum(1 for b in bins if 2 * sum(lengths[i] for i in b) <= capacity) <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), max_size=40), st.integers(30, 50))
def test_ffd_is_deterministic_and_first_fit(lengths, capacity):
    bins = ffd_bins(lengths, capacity)
    assert bins == ffd_bins(list(lengths), capacity)
    # Replaying the decreasing order: each sample sits in the first bin that had room then.
    fill = [0] * len(bins)
    where = {i: b for b, members in enumerate(bins) for i in members}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        first = next(b for b in range(len(bins)) if fill[b] + lengths[i] <= capacity)
        assert where[i] == first
        fill[first] += lengths[i]


def test_ffd_packs_tightly_when_possible():
    assert ffd_bins([5, 5, 3, 7], 10) == [[3, 2], [0, 1]]
    assert packing_efficiency(20, 2, 10) == 1.0


def test_ffd_rejects_out_of_range_lengths():
    with pytest.raises(ValueError):
        ffd_bins([3, 11], 10)
    with pytest.raises(ValueError):
        ffd_bins([0], 10)


def _doc(start: int, n: int) -> tuple[list[int], list[int], list[int]]:
    ids = list(range(start, start + n))
    return ids, list(ids), list(range(n))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=20), st.integers(12, 40))
def test_rows_keep_tokens_and_mark_every_boundary(lengths, capacity):
    docs, start = [], 0
    for n in lengths:
        docs.append(_doc(start, n))
        start += n
    rows = [make_row(docs[i] for i in b) for b in ffd_bins(lengths, capacity)]
    seen = Counter(t for r in rows for t in r["input_ids"])
    assert seen == Counter(range(start))  # every token exactly once
    for r in rows:
        assert len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"]) <= capacity
        assert r["position_ids"][0] == 0
        for t, p in enumerate(r["position_ids"]):
            if p == 0:
                assert r["labels"][t] == IGNORE  # first token of a document: never a target
            else:
                assert r["position_ids"][t - 1] == p - 1  # positions count up inside a document
                assert r["labels"][t] == r["input_ids"][t]


def test_make_row_keeps_masks_inside_documents():
    row = make_row([([7, 8, 9], [-100, -100, 9], [0, 1, 2]), ([4, 5], [4, 5], [0, 1])])
    assert row == {
        "input_ids": [7, 8, 9, 4, 5],
        "labels": [-100, -100, 9, -100, 5],
        "position_ids": [0, 1, 2, 0, 1],
    }
