"""The series layout's window index from window starts, against an explicit union of rows."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.series import RunIndexer, covered_rows, covered_spans


def explicit(starts: np.ndarray, H: int, F: int, stride: int):
    """Brute force: the sorted stored rows of each group, each window's position of its first
    row among them, and which windows begin a segment."""
    x_rows = sorted({r for t in starts for r in range(t - H, t)})
    f_rows = sorted({r for t in starts for r in range(t, t + F)})
    x_pos = [x_rows.index(t - H) for t in starts]
    f_pos = [f_rows.index(t) for t in starts]
    new = [i == 0 or starts[i] - starts[i - 1] != stride for i in range(len(starts))]
    return x_rows, f_rows, x_pos, f_pos, new


@pytest.mark.parametrize("H,F,stride", [(5, 3, 1), (3, 5, 2), (4, 4, 4), (3, 2, 7), (6, 2, 3)])
@pytest.mark.parametrize("seed", range(4))
def test_offsets_and_segments_equal_the_explicit_union_whatever_the_slices(H, F, stride, seed):
    rng = np.random.default_rng(seed)
    candidates = np.arange(H, 400 - F + 1, stride)
    starts = np.sort(rng.choice(candidates, size=rng.integers(1, len(candidates)), replace=False))
    x_rows, f_rows, x_pos, f_pos, new = explicit(starts, H, F, stride)
    cuts = np.sort(rng.choice(np.arange(1, len(starts)), size=min(3, len(starts) - 1), replace=False)) if len(starts) > 1 else []
    indexer = RunIndexer(H, F, stride)
    blocks = [indexer.feed(part) for part in np.split(starts, cuts)] + [indexer.feed(np.empty(0, np.int64))]
    assert np.array_equal(np.concatenate([b.starts for b in blocks]), starts)
    assert np.concatenate([b.x_row for b in blocks]).tolist() == x_pos
    assert np.concatenate([b.future_row for b in blocks]).tolist() == f_pos
    assert np.concatenate([b.new_segment for b in blocks]).tolist() == new
    assert (indexer.x_rows, indexer.future_rows) == (len(x_rows), len(f_rows))
    assert (indexer.windows, indexer.segments) == (len(starts), sum(new))
    # Inside a segment the rows advance by min(stride, steps) a window.
    seg_first = np.flatnonzero(new)
    j = np.arange(len(starts)) - seg_first[np.searchsorted(seg_first, np.arange(len(starts)), side="right") - 1]
    k_first = np.arange(len(starts)) - j
    assert np.array_equal(np.array(x_pos), np.array(x_pos)[k_first] + j * min(stride, H))
    assert np.array_equal(np.array(f_pos), np.array(f_pos)[k_first] + j * min(stride, F))
    # Which rows of any block are stored is the same union.
    for r0, n in ((0, 400), (37, 50), (390, 10)):
        hist = covered_rows(starts, r0, n, -H, 0)
        fut = covered_rows(starts, r0, n, 0, F)
        assert np.flatnonzero(hist).tolist() == [r - r0 for r in x_rows if r0 <= r < r0 + n]
        assert np.flatnonzero(fut).tolist() == [r - r0 for r in f_rows if r0 <= r < r0 + n]
        # As stretches: the same rows, each stretch maximal.
        for rows, (lo, hi) in ((hist, (-H, 0)), (fut, (0, F))):
            begin, end = covered_spans(starts, r0, n, lo, hi)
            assert np.concatenate([np.arange(b, e) for b, e in zip(begin, end)] + [[]]).tolist() == np.flatnonzero(rows).tolist()
            assert np.all(begin[1:] > end[:-1])


def test_a_run_without_windows_stores_nothing_and_starts_must_ascend():
    indexer = RunIndexer(4, 2, 1)
    assert indexer.feed(np.empty(0, np.int64)).starts.size == 0
    assert (indexer.x_rows, indexer.future_rows, indexer.segments) == (0, 0, 0)
    indexer.feed(np.array([10, 11]))
    with pytest.raises(ValueError, match="ascend strictly"):
        indexer.feed(np.array([11, 12]))
    with pytest.raises(ValueError, match="history must be"):
        RunIndexer(0, 2, 1)
