"""Which query rows see which keys, in whole numbers: segments, blocks and pieces.

No tensors here (the numerics that run these blocks are :mod:`.torch_kernel`'s). Work is
split into *segments* (:class:`~.features.Segment`): a run of consecutive query rows of one
document. A segment with queries ``q[q_start:q_end]`` whose last key is ``k_end`` attends to
``k[k_start:k_end]`` with bottom-right causal alignment (query ``q_end - 1`` sees key
``k_end - 1``): a query sits at *key position* ``k_end - (q_end - row)``. Each segment is cut
into *blocks* so that no ``T x T`` mask is ever built:

* no window (or one the segment never reaches past): the *prefix* ``k[k_start : k_end - n]``
  (``n`` = number of queries), fully visible, and the *diagonal* ``k[k_end - n : k_end]``, a
  square causal block;
* a sliding window ``W`` (query at key position ``p`` sees keys ``p - W + 1 .. p``, never
  before its document start): query rows in blocks of ``b <= W`` rows; each has a causal
  diagonal, a fully visible middle, and a left *edge* of at most ``b - 1`` keys whose
  ``b x b`` band mask is the only mask built;
* a bidirectional segment (an image's tokens) sees every key up to its end: one block with
  no mask, or under a window the rows of :func:`rows_seeing_to_end`.

A P2P ring's key block is described by :class:`Piece` s instead (:func:`piece_blocks`,
:func:`piece_flash_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .features import Segment

MAX_ROWS = 512  # query rows per block under a window: bounds the edge mask to 512 x 512


class Block(NamedTuple):
    """Query rows ``[q0, q1)`` against keys ``[k0, k1)``; row ``q0`` sits at key position ``pos``.

    ``masked`` is False when every (row, key) pair is visible.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    pos: int
    masked: bool


def full_row_segments(cu_seqlens: Sequence[int],
                      prefixes: tuple[tuple[int, int, int], ...] = (),
                      bidirectional: tuple[tuple[int, int], ...] = ()) -> tuple[Segment, ...]:
    """Segments for a full row where queries and keys are the same tokens (one per document;
    a branch document's with its prefix, see `SPMeta.prefixes`). A document holding
    `bidirectional` runs (`SPMeta.bidirectional`) is cut at them: each run is a segment
    whose queries see every key of the document up to the run's end."""
    bounds = list(cu_seqlens)
    shared = {start: (p0, p1) for start, p0, p1 in prefixes}
    if not bidirectional:
        return tuple(Segment(a, b, a, b, *shared.get(a, (0, 0)))
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
    if prefixes:
        raise ValueError("bidirectional image tokens with shared pair prompts "
                         "(`prefix_sharing`) are not supported")
    out, runs = [], iter(sorted(bidirectional))
    run = next(runs, None)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cut = a
        while run is not None and run[0] < b:
            s, e = run
            if s < a or e > b:
                raise ValueError(f"bidirectional run {run} crosses a document bound ({a}, {b})")
            if cut < s:
                out.append(Segment(cut, s, a, s))
            out.append(Segment(s, e, a, e, bidirectional=True))
            cut, run = e, next(runs, None)
        if cut < b:
            out.append(Segment(cut, b, a, b))
    return tuple(out)


def sees_whole(seg: Segment, window: int | None) -> bool:
    """Whether every row of a bidirectional segment sees all its keys (one block with no
    mask, which the op's non-causal block call computes); under a window narrower than its
    keys it does not, and runs on the block paths."""
    return window is None or window >= seg.k_end - seg.k_start


def whole_block(segments: Sequence[Segment], rows: int, window: int | None) -> slice | None:
    """The key slice when one unwindowed causal square covers all ``rows`` query rows."""
    if len(segments) != 1:
        return None
    seg = segments[0]
    if (seg.q_start != 0 or seg.q_end != rows or seg.k_end - seg.k_start != rows
            or seg.has_prefix or seg.bidirectional):
        return None
    if window is not None and window < rows:
        return None
    return slice(seg.k_start, seg.k_end)


def is_plain_causal(blk: Block, window: int | None) -> bool:
    """A square block whose rows sit on its keys, within the window: the causal flag covers it."""
    rows = blk.q1 - blk.q0
    in_window = window is None or window >= rows
    return blk.pos == blk.k0 and rows == blk.k1 - blk.k0 and in_window


def segment_blocks(seg: Segment, window: int | None) -> list[list[Block]]:
    """The blocks of one segment, grouped by the query rows they cover (see module doc).

    A group's first block covers all its rows, later ones a prefix of them. In every block
    each row sees at least one key, so no block has an empty softmax.
    """
    n = seg.q_end - seg.q_start
    if n == 0:
        return []
    diag = seg.k_end - n
    if seg.bidirectional:
        reach = None if sees_whole(seg, window) else window
        return rows_seeing_to_end(seg.q_start, seg.q_end, diag, seg.k_start, seg.k_end, reach)
    if seg.has_prefix and window is not None:
        raise ValueError("sliding-window attention with shared pair prompts (`prefix_sharing`) "
                         "is not supported")
    if window is None or window >= seg.k_end - seg.k_start:  # the window clips nothing here
        blocks = [Block(seg.q_start, seg.q_end, diag, seg.k_end, diag, True)]
        if diag > seg.k_start:
            blocks.append(Block(seg.q_start, seg.q_end, seg.k_start, diag, diag, False))
        if seg.has_prefix:  # a branch: the shared prefix is visible to every row
            blocks.append(Block(seg.q_start, seg.q_end, seg.p_start, seg.p_end, diag, False))
        return [blocks]
    rows = min(window, MAX_ROWS)  # <= window: the diagonal stays plain causal
    groups = []
    for r0 in range(seg.q_start, seg.q_end, rows):
        r1 = min(r0 + rows, seg.q_end)
        p0 = diag + r0 - seg.q_start
        p1 = p0 + r1 - r0
        blocks = [Block(r0, r1, p0, p1, p0, True)]
        full0 = max(seg.k_start, p1 - window)  # the last row's first key
        if full0 < p0:
            blocks.append(Block(r0, r1, full0, p0, p0, False))
        edge0 = max(seg.k_start, p0 - window + 1)  # the first row's first key
        if edge0 < full0:  # the last row sees none of the edge, every other row some
            blocks.append(Block(r0, r1 - 1, edge0, full0, p0, True))
        groups.append(blocks)
    return groups


def rows_seeing_to_end(r0: int, r1: int, pos: int, k0: int, k1: int, window: int | None
                       ) -> list[list[Block]]:
    """Block groups of rows ``[r0, r1)`` (row ``r0`` at key position ``pos``) that see every
    key of ``[k0, k1)`` except those before their window: rows after all the keys (a P2P
    ring's piece), or an image's tokens, which see to the image's end whatever their place.
    """
    if window is None:
        return [[Block(r0, r1, k0, k1, pos, False)]]
    groups = []
    rows = min(window, MAX_ROWS)
    for a in range(r0, r1, rows):
        b = min(a + rows, r1)
        p0 = pos + a - r0
        p1 = p0 + b - a
        full0 = max(k0, p1 - window)  # the last row's first key: every row sees [full0, k1)
        blocks = [Block(a, b, full0, k1, p0, False)]
        edge0 = max(k0, p0 - window + 1)  # the first row's first key
        if edge0 < full0:  # the last row sees none of the edge, every other row some
            blocks.append(Block(a, b - 1, edge0, full0, p0, True))
        groups.append(blocks)
    return groups


class Piece(NamedTuple):
    """Query rows ``[q0, q1)`` at key positions ``pos0 ..`` against keys ``[k0, k1)``.

    The generalisation of :class:`~.features.Segment` a P2P ring needs: the keys are one
    rank's block, so they may end before the queries (all visible, or cut by the window) or
    start after some of them (those rows see nothing here). Row ``q0 + i`` sits at key
    position ``pos0 + i``; it sees key ``j`` iff ``k0 <= j < k1``, ``j <= pos`` and, under a
    window ``W``, ``j > pos - W``.
    """

    q0: int
    q1: int
    pos0: int
    k0: int
    k1: int


def piece_flash_calls(
    pieces: Sequence[Piece], window: int | None
) -> list[tuple[int, int, int, int, bool]] | None:
    """The pieces as fused-op block calls ``(q0, q1, k0, k1, causal)``, or None when one
    cannot be.

    A piece's rows among its keys are a bottom-right causal block (the window, if any, as
    the op's ``(W - 1, 0)``); its rows after every key see them all, a block with no mask,
    except under a window (their window is not aligned to the block's diagonal). The split
    is :func:`piece_blocks`'s.
    """
    calls = []
    for q0, q1, pos0, k0, k1 in pieces:
        lo, hi = max(pos0, k0), pos0 + (q1 - q0)
        if window is not None:
            hi = min(hi, k1 + window - 1)
        if lo >= hi or k0 >= k1:
            continue
        mid = min(hi, max(lo, k1))
        if lo < mid:
            calls.append((q0 + lo - pos0, q0 + mid - pos0, k0, mid, True))
        if mid < hi:
            if window is not None:
                return None
            calls.append((q0 + mid - pos0, q0 + hi - pos0, k0, k1, False))
    return calls


def piece_blocks(piece: Piece, window: int | None) -> list[list[Block]]:
    """The block groups of one piece; rows that see no key of the piece get none."""
    q0, q1, pos0, k0, k1 = piece
    lo = max(pos0, k0)  # rows before the first key see nothing
    hi = pos0 + (q1 - q0)
    if window is not None:
        hi = min(hi, k1 + window - 1)  # rows whose window ends before the keys' start
    if lo >= hi or k0 >= k1:
        return []
    groups: list[list[Block]] = []
    mid = min(hi, max(lo, k1))  # rows before mid sit among the keys, the rest after them
    if lo < mid:  # rows whose own position is among the keys: a causal segment
        seg = Segment(q0 + lo - pos0, q0 + mid - pos0, k0, mid)
        groups += segment_blocks(seg, window)
    if mid >= hi:
        return groups
    # Rows after every key: each sees all of them its window reaches.
    return groups + rows_seeing_to_end(q0 + mid - pos0, q0 + hi - pos0, mid, k0, k1, window)
