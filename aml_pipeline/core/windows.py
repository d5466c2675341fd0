"""Sliding windows over one run's aligned grid (docs/spec.md, windows).

A window starting at grid row ``t`` uses ``x`` = rows ``t-H..t-1`` of every node, ``u`` = rows
``t..t+F-1`` of the controls and ``y`` = rows ``t..t+F-1`` of the targets. It is dropped if anything
it *uses* is missing: a gap in a pure feature's future does not cost a window, because that part
of the feature is never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from aml_pipeline.core.args import as_int, positive_int, window_spans


class StartFinder:
    """Start rows ``t = H, H+stride, ... <= T-F`` of the complete windows (int64, ascending), over
    a run's grid fed in row blocks of any size (bounded memory).

    A start ``t`` is decided once rows up to ``t+F-1`` are in; it needs rows ``t-H..t+F-1``, so at
    most the last ``H + F - 1`` rows' "has a missing value" flags are carried to the next block.
    Prefix sums of those flags answer "any missing in rows a..b-1" for every candidate at once.
    """

    def __init__(
        self,
        n_rows: int,
        n_cols: int,
        history: int,
        horizon: int,
        stride: int,
        control_cols: Sequence[int],
        target_cols: Sequence[int],
    ) -> None:
        self.n_rows = as_int("n_rows", n_rows)
        self.n_cols = as_int("n_cols", n_cols)
        self.H, self.F = positive_int("history", history), positive_int("horizon", horizon)
        self.stride = positive_int("stride", stride)
        ctrl = _cols("control_cols", control_cols, self.n_cols)
        tgt = _cols("target_cols", target_cols, self.n_cols)
        self.future_cols = np.union1d(ctrl, tgt)
        self.fed = 0  # rows fed so far
        self.next_start = self.H  # first candidate not decided yet
        self._buf_first = 0  # row index of the first buffered flag
        self._past_bad = np.empty(0, dtype=bool)  # row has a missing value in any column
        self._future_bad = np.empty(0, dtype=bool)  # ... in a control or target column

    def feed(self, block: np.ndarray) -> np.ndarray:
        """Add the next rows; returns the complete-window starts this block decided."""
        block = _grid(block)
        if block.shape[1] != self.n_cols:
            raise ValueError(f"StartFinder: block has {block.shape[1]} columns, expected {self.n_cols}")
        if self.fed + block.shape[0] > self.n_rows:
            raise ValueError(f"StartFinder: more than the run's {self.n_rows} rows were fed")
        bad = ~np.isfinite(block)
        self._past_bad = np.concatenate([self._past_bad, bad.any(axis=1)])
        future = bad[:, self.future_cols].any(axis=1) if self.future_cols.size else np.zeros(block.shape[0], bool)
        self._future_bad = np.concatenate([self._future_bad, future])
        self.fed += block.shape[0]
        return self._decide()

    def finish(self) -> np.ndarray:
        if self.fed != self.n_rows:
            raise ValueError(f"StartFinder: {self.fed} of the run's {self.n_rows} rows were fed")
        return self._decide()

    def _decide(self) -> np.ndarray:
        H, F = self.H, self.F
        last = min(self.fed, self.n_rows) - F  # largest start whose rows are all in
        if last < self.next_start:
            return np.empty(0, dtype=np.int64)
        starts = np.arange(self.next_start, last + 1, self.stride, dtype=np.int64)
        b0 = self._buf_first
        past = np.zeros(self._past_bad.size + 1, dtype=np.int64)
        np.cumsum(self._past_bad, out=past[1:])
        future = np.zeros(self._future_bad.size + 1, dtype=np.int64)
        np.cumsum(self._future_bad, out=future[1:])
        s = starts - b0
        ok = (past[s] == past[s - H]) & (future[s + F] == future[s])
        self.next_start = int(starts[-1]) + self.stride
        drop = max(0, min(self.next_start - H, self.fed) - b0)
        self._past_bad, self._future_bad = self._past_bad[drop:], self._future_bad[drop:]
        self._buf_first = b0 + drop
        return starts[ok]


def window_block(values: np.ndarray, starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``t+lo..t+hi-1`` of ``values [T, cols]`` for every start ``t``: a new ``[N, hi-lo, cols]`` array.

    The building block of x (``lo=-H, hi=0``), u/y (``lo=0, hi=F``) and timestamps (``-H, F``),
    so a caller can normalise whole grid columns once and then cut windows, in any dtype.
    """
    values = np.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"window_block: values must be 2-D [rows, cols], got shape {values.shape}")
    starts, lo, hi = window_spans("window_block", starts, lo, hi, values.shape[0])
    steps, cols = hi - lo, values.shape[1]
    if starts.size == 0 or cols == 0:
        return np.empty((starts.size, steps, cols), dtype=values.dtype)
    # Every window is one contiguous [steps, cols] block of the C-ordered rows: index the first
    # axis of the (zero-copy) view of all blocks, so numpy copies whole blocks rather than
    # gathering rows one at a time.
    blocks = sliding_window_view(np.ascontiguousarray(values), (steps, cols))[:, 0]
    return blocks[starts + lo]


def explain_no_windows(
    n_rows: int, history: int, horizon: int, missing_rows: Sequence[int], node_ids: Sequence[str]
) -> str:
    """One line saying why a run yields no window (meant for runs where StartFinder found no start).

    ``missing_rows``: per node, how many of the run's ``n_rows`` grid rows are missing (counted
    while the grid streams past, so the grid itself is not needed).
    """
    T = as_int("n_rows", n_rows)
    H, F = positive_int("history", history), positive_int("horizon", horizon)
    missing = np.asarray(list(missing_rows), dtype=np.int64)
    if missing.shape != (len(node_ids),):
        raise ValueError(f"explain_no_windows: {missing.size} missing counts for {len(node_ids)} node ids")
    if T < H + F:
        return f"run has {T} grid rows, fewer than historySteps + horizonSteps = {H + F}"
    ratios = missing / T
    order = [j for j in np.argsort(-ratios, kind="stable") if ratios[j] > 0][:3]
    if not order:
        return "no window without missing values"
    parts = [
        f"{node_ids[j]} ({_percent(float(ratios[j]))}{' missing' if i == 0 else ''})"
        for i, j in enumerate(order)
    ]
    return "no window without missing values; most missing: " + ", ".join(parts)


def _percent(r: float) -> str:
    # "0%" for a node that is missing somewhere would read as "not the problem".
    if r < 0.01:
        return "<1%"
    if r < 1.0 and round(r * 100) == 100:
        return ">99%"
    return f"{round(r * 100)}%"


def _grid(grid: np.ndarray) -> np.ndarray:
    grid = np.asarray(grid)
    if grid.ndim != 2:
        raise ValueError(f"grid must be 2-D [rows, nodes], got shape {grid.shape}")
    if not np.issubdtype(grid.dtype, np.floating):
        raise ValueError(f"grid must be floating point (NaN = missing), got dtype {grid.dtype}")
    return grid


def _cols(name: str, cols: Sequence[int], n_nodes: int) -> np.ndarray:
    arr = np.asarray(list(cols))
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
        raise ValueError(f"{name} must be a sequence of column indices, got {list(cols)!r}")
    bad = arr[(arr < 0) | (arr >= n_nodes)]
    if bad.size:
        raise ValueError(
            f"{name}: column index {int(bad[0])} is out of range for a grid with {n_nodes} columns"
        )
    return arr.astype(np.int64)
