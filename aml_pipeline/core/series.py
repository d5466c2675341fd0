"""The series layout's window index, derived from a run's window starts alone (docs/snapshot.md).

A series snapshot stores each grid row windows read once: the rows some window reads as history
(``x``, rows ``t-H .. t-1``) and the rows some window reads as future (``u``/``y``, rows
``t .. t+F-1``), each in ascending order. Because a run's starts ascend, where a window's rows
sit among the stored rows follows from the starts: the union of ``[t-H, t)`` over the starts up
to window ``i`` grows by ``min(H, t_i - t_{i-1})`` rows with window ``i``, so its first history
row is stored row ``sum(min(H, delta))`` of the run (likewise with ``F`` for the future). No row
has to be read to build the index, and the windows' rows are contiguous among the stored rows.

A segment is a maximal stretch of a run's windows whose starts are ``stride`` apart: inside it,
window ``j``'s start, history row and future row are the first window's plus ``j * stride``,
``j * min(stride, H)`` and ``j * min(stride, F)``, so the index stores one entry per segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aml_pipeline.core.args import positive_int
from aml_pipeline.core.normalize import block_row_weights


@dataclass(frozen=True)
class RunIndexBlock:
    """What a slice of a run's starts gives: per window, its start, the run-relative stored row
    of its first history row and of its first future row, and whether it begins a segment."""

    starts: np.ndarray  # int64 [n]
    x_row: np.ndarray  # int64 [n]
    future_row: np.ndarray  # int64 [n]
    new_segment: np.ndarray  # bool [n]


class RunIndexer:
    """:class:`RunIndexBlock` s of one run, fed its ascending starts in slices of any size."""

    def __init__(self, history: int, horizon: int, stride: int) -> None:
        self.H, self.F = positive_int("history", history), positive_int("horizon", horizon)
        self.stride = positive_int("stride", stride)
        self.windows = 0
        self.segments = 0
        self._last: tuple[int, int, int] | None = None  # (start, x_row, future_row) of the last window fed

    def feed(self, starts: np.ndarray) -> RunIndexBlock:
        starts = np.asarray(starts, dtype=np.int64)
        if starts.ndim != 1:
            raise ValueError(f"RunIndexer.feed: starts must be 1-D, got shape {starts.shape}")
        if starts.size == 0:
            empty = np.empty(0, dtype=np.int64)
            return RunIndexBlock(empty, empty, empty, np.empty(0, dtype=bool))
        if self._last is None:  # the run's first window: its rows are the run's first stored rows
            delta = np.diff(starts)
            new = np.concatenate([[True], delta != self.stride])
            x_row = np.concatenate([[0], np.cumsum(np.minimum(delta, self.H))])
            f_row = np.concatenate([[0], np.cumsum(np.minimum(delta, self.F))])
        else:
            prev, x_prev, f_prev = self._last
            delta = np.diff(starts, prepend=prev)
            new = delta != self.stride
            x_row = x_prev + np.cumsum(np.minimum(delta, self.H))
            f_row = f_prev + np.cumsum(np.minimum(delta, self.F))
        if np.any(delta <= 0):
            raise ValueError("RunIndexer.feed: window starts must ascend strictly")
        self._last = (int(starts[-1]), int(x_row[-1]), int(f_row[-1]))
        self.windows += int(starts.size)
        self.segments += int(np.count_nonzero(new))
        return RunIndexBlock(starts, x_row, f_row, new)

    @property
    def x_rows(self) -> int:
        """Stored history rows of the starts fed so far (their union of ``[t-H, t)``)."""
        return 0 if self._last is None else self._last[1] + self.H

    @property
    def future_rows(self) -> int:
        """Stored future rows of the starts fed so far (their union of ``[t, t+F)``)."""
        return 0 if self._last is None else self._last[2] + self.F


def covered_rows(starts: np.ndarray, first_row: int, n_rows: int, lo: int, hi: int) -> np.ndarray:
    """Which of the rows ``first_row .. first_row + n_rows - 1`` some window reads, the window at
    start ``t`` reading rows ``t+lo .. t+hi-1`` (bool ``[n_rows]``; ``starts`` must include every
    window that reads one of those rows)."""
    return block_row_weights(starts, first_row, n_rows, lo, hi) > 0


def covered_spans(starts: np.ndarray, first_row: int, n_rows: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`covered_rows` as maximal stretches: the rows some window reads are
    ``begin[i] .. end[i] - 1`` (relative to ``first_row``; ascending, disjoint, not touching).

    ``starts`` must ascend. The windows' spans ``[t+lo, t+hi)`` overlap or touch when their
    starts are at most ``hi - lo`` apart, so a stretch ends where two starts are further apart.
    """
    starts = np.asarray(starts, dtype=np.int64)
    if starts.size == 0 or n_rows <= 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    breaks = np.flatnonzero(np.diff(starts) > hi - lo)
    begin = np.clip(starts[np.concatenate([[0], breaks + 1])] + (lo - first_row), 0, n_rows)
    end = np.clip(starts[np.concatenate([breaks, [starts.size - 1]])] + (hi - first_row), 0, n_rows)
    kept = end > begin
    return begin[kept], end[kept]
