"""Normalisation statistics fitted on train windows only, and their application (docs/spec.md, normalisation).

Fit and transform are separate so the fit can stream over runs (one run's grid in memory at a time)
and the transform can never see anything but the frozen statistics.

Statistics are per column over every value a train window *uses* (x: every node over the H history
rows; u: controls over the F future rows; y: targets over the F future rows). Overlapping windows
use a grid row many times, so instead of materialising windows each grid row is weighted by the
number of train windows that use it (:func:`window_row_weights`); the weighted moments equal the
moments over the explicit windows.

Accumulation is float64 with a per-batch two-pass (mean, then centred squares) and Chan et al.'s
pairwise merge across batches. A naive running sum of squares cancels catastrophically for plant
signals such as 300 K +- 0.01 K.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aml_pipeline.core.args import as_int, window_spans


@dataclass(frozen=True, eq=False)  # eq on numpy fields would be ambiguous
class NormStats:
    mean: np.ndarray  # float64 [cols]
    std: np.ndarray  # float64 [cols]; population (ddof 0), 1.0 where the data had none
    zero_std: np.ndarray  # bool [cols]: std was 0 and was replaced by 1.0
    count: float  # total weight (number of values per column)

    def to_json(self) -> dict[str, list[float]]:
        return {"mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch's weighted count, mean and M2 per column, before merging (:func:`batch_moments`)."""

    count: float
    mean: np.ndarray  # float64 [cols]
    m2: np.ndarray  # float64 [cols]


def batch_moments(values: np.ndarray, weights: np.ndarray | None, n_cols: int) -> Batch | None:
    """The two-pass weighted moments of one batch of ``[rows, n_cols]`` values (None: no row of
    weight > 0). Pure: independent batches may be computed at once, then merged in order with
    :meth:`MomentAccumulator.add_batch`; only the merges' order shapes the bits."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != n_cols:
        raise ValueError(
            f"MomentAccumulator.add: values must be [rows, {n_cols}], got shape {values.shape}"
        )
    if weights is None:
        w = np.ones(values.shape[0])
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (values.shape[0],):
            raise ValueError(
                f"MomentAccumulator.add: weights must have shape ({values.shape[0]},), got {w.shape}"
            )
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise ValueError("MomentAccumulator.add: weights must be finite and >= 0")
    used = w > 0
    if not used.any():
        return None
    every = bool(used.all())
    if not every:
        w = w[used]
    total = float(w.sum())
    if n_cols == 0:
        return Batch(total, np.zeros(0), np.zeros(0))
    # [cols, rows] so each column's sums reduce along contiguous memory: numpy's pairwise
    # summation, accurate and identical on every machine (a BLAS dot would be neither).
    vt = np.ascontiguousarray(values.T if every else values.T[:, used])
    if not np.isfinite(vt).all():
        col = int(np.flatnonzero(~np.isfinite(vt).all(axis=1))[0])
        raise ValueError(
            f"MomentAccumulator.add: column {col} has a non-finite value in a row of weight > 0"
        )
    own = not np.may_share_memory(vt, values)  # a copy: free to overwrite
    # Two [cols, rows] temporaries, reused: the same products and sums as with new arrays.
    wd = np.multiply(vt, w)
    mean = wd.sum(axis=1) / total
    # The true mean lies within [min, max]; clamping makes a constant column's mean exact, so
    # its M2 is exactly 0 and it is flagged zero_std instead of getting a std of rounding noise.
    np.clip(mean, vt.min(axis=1), vt.max(axis=1), out=mean)
    d = np.subtract(vt, mean[:, None], out=vt if own else None)
    np.multiply(d, w, out=wd)
    # Second term: the classic correction for the rounding error left in the mean.
    correction = wd.sum(axis=1) ** 2 / total
    m2 = np.multiply(wd, d, out=d).sum(axis=1) - correction
    np.maximum(m2, 0.0, out=m2)
    return Batch(total, mean, m2)


class MomentAccumulator:
    """Streaming weighted count, mean and M2 (sum of squared deviations) per column."""

    def __init__(self, n_cols: int) -> None:
        n_cols = as_int("n_cols", n_cols)
        if n_cols < 0:
            raise ValueError(f"MomentAccumulator: n_cols must be >= 0, got {n_cols}")
        self.n_cols = n_cols
        self.count = 0.0
        self.mean = np.zeros(n_cols)
        self.m2 = np.zeros(n_cols)

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Add ``[rows, cols]`` values, row ``r`` counted ``weights[r]`` times (default once).

        Rows of weight 0 are ignored entirely, so they may hold NaN (grid rows no window uses).
        """
        self.add_batch(batch_moments(values, weights, self.n_cols))

    def add_batch(self, batch: Batch | None) -> None:
        """Merge one batch's moments (from :func:`batch_moments`, None: no rows): the same
        arithmetic as :meth:`add` on that batch's values, so batches computed elsewhere (e.g. in
        other threads) and merged here in the same order give the same bits."""
        if batch is None:
            return
        if batch.mean.shape != (self.n_cols,):
            raise ValueError(f"MomentAccumulator.add_batch: {batch.mean.shape[0]} columns into {self.n_cols}")
        self._merge(batch.count, batch.mean, batch.m2)

    def merge(self, other: MomentAccumulator) -> None:
        """Fold another accumulator (e.g. another run's) into this one."""
        if other.n_cols != self.n_cols:
            raise ValueError(f"MomentAccumulator.merge: {other.n_cols} columns into {self.n_cols}")
        self._merge(other.count, other.mean, other.m2)

    def _merge(self, n_b: float, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        if n_b == 0:
            return
        n_a = self.count
        if n_a == 0:
            self.count, self.mean, self.m2 = n_b, mean_b.copy(), m2_b.copy()
            return
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (n_a * n_b / n)
        self.count = n

    def result(self) -> NormStats:
        if self.count == 0:
            raise ValueError("no training windows: normalisation statistics need at least one train window")
        std = np.sqrt(self.m2 / self.count)
        zero = std == 0.0
        std[zero] = 1.0
        return NormStats(mean=self.mean.copy(), std=std, zero_std=zero, count=self.count)


def window_row_weights(starts: np.ndarray, n_rows: int, lo: int, hi: int) -> np.ndarray:
    """For every grid row ``r``, the number of starts ``t`` with ``t + lo <= r < t + hi`` (int64).

    x uses ``lo=-H, hi=0``; u and y use ``lo=0, hi=F``.
    """
    n_rows = as_int("n_rows", n_rows)
    if n_rows < 0:
        raise ValueError(f"window_row_weights: n_rows must be >= 0, got {n_rows}")
    starts, lo, hi = window_spans("window_row_weights", starts, lo, hi, n_rows)
    return block_row_weights(starts, 0, n_rows, lo, hi)


def block_row_weights(starts: np.ndarray, first_row: int, n_rows: int, lo: int, hi: int) -> np.ndarray:
    """:func:`window_row_weights` for the rows ``first_row .. first_row + n_rows - 1`` of a run only:
    windows that reach outside the block count for the part inside it."""
    starts = np.asarray(starts, dtype=np.int64)
    # Difference array: +1 where a window's (clipped) span begins, -1 one past its end; the running
    # sum is the number of spans covering each row. A span wholly outside adds +1 and -1 at once.
    a = np.clip(starts + (lo - first_row), 0, n_rows)
    b = np.clip(starts + (hi - first_row), 0, n_rows)
    diff = np.bincount(a, minlength=n_rows + 1) - np.bincount(b, minlength=n_rows + 1)
    return np.cumsum(diff[:n_rows], dtype=np.int64)


def accumulate_window_stats(
    acc_x: MomentAccumulator,
    acc_u: MomentAccumulator,
    acc_y: MomentAccumulator,
    grid: np.ndarray,
    starts: np.ndarray,
    history: int,
    horizon: int,
    control_cols: Sequence[int],
    target_cols: Sequence[int],
    *,
    first_row: int | None = None,
) -> None:
    """Add (train) windows, given by their ``starts`` on a run's grid, to the accumulators.

    ``grid`` holds the run's rows ``first_row ..`` (None: the whole run, every window inside it);
    otherwise only the parts of
    the windows inside those rows are added, so a run can be streamed block by block, each block
    with the starts of every window that touches it. Each call is one batch of the accumulators
    (two-pass, merged by Chan et al.), so a caller that wants bytes independent of how a run is
    read must call it on fixed blocks.
    """
    grid, H, F, ctrl, tgt = _window_args(grid, history, horizon, control_cols, target_cols)
    n_nodes = grid.shape[1]
    for name, acc, n in (("acc_x", acc_x, n_nodes), ("acc_u", acc_u, len(ctrl)), ("acc_y", acc_y, len(tgt))):
        if acc.n_cols != n:
            raise ValueError(f"{name} has {acc.n_cols} columns, expected {n}")
    for acc, batch in zip((acc_x, acc_u, acc_y), _window_batches(grid, starts, H, F, ctrl, tgt, first_row),
                          strict=True):
        acc.add_batch(batch)


def _window_args(
    grid: np.ndarray, history: int, horizon: int, control_cols: Sequence[int], target_cols: Sequence[int]
) -> tuple[np.ndarray, int, int, list[int], list[int]]:
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 2:
        raise ValueError(f"grid must be 2-D [rows, nodes], got shape {grid.shape}")
    H, F = as_int("history", history), as_int("horizon", horizon)
    if H < 1 or F < 1:
        raise ValueError(f"history and horizon must be >= 1, got {H} and {F}")
    n_nodes = grid.shape[1]
    ctrl, tgt = list(control_cols), list(target_cols)
    for name, cols in (("control_cols", ctrl), ("target_cols", tgt)):
        for c in cols:
            if not (0 <= as_int(name, c) < n_nodes):
                raise ValueError(
                    f"{name}: column index {c} is out of range for a grid with {n_nodes} columns"
                )
    return grid, H, F, ctrl, tgt


def window_batches(
    grid: np.ndarray,
    starts: np.ndarray,
    history: int,
    horizon: int,
    control_cols: Sequence[int],
    target_cols: Sequence[int],
    *,
    first_row: int | None = None,
) -> tuple[Batch | None, Batch | None, Batch | None]:
    """The x, u and y batches that :func:`accumulate_window_stats` merges, without merging them:
    pure, so the blocks of a fit can be computed at once and merged in their order."""
    grid, H, F, ctrl, tgt = _window_args(grid, history, horizon, control_cols, target_cols)
    return _window_batches(grid, starts, H, F, ctrl, tgt, first_row)


def _window_batches(
    grid: np.ndarray, starts: np.ndarray, H: int, F: int, ctrl: list[int], tgt: list[int], first_row: int | None
) -> tuple[Batch | None, Batch | None, Batch | None]:
    T = grid.shape[0]
    if first_row is None:
        past = window_row_weights(starts, T, -H, 0)
        future = window_row_weights(starts, T, 0, F)
    else:
        first = as_int("first_row", first_row)
        past = block_row_weights(starts, first, T, -H, 0)
        future = block_row_weights(starts, first, T, 0, F)
    return (
        batch_moments(grid, past, grid.shape[1]),
        batch_moments(grid[:, ctrl], future, len(ctrl)),
        batch_moments(grid[:, tgt], future, len(tgt)),
    )


def apply_norm(values: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``float32((v - mean) / std)`` computed in float64, broadcasting over the last axis."""
    v = np.asarray(values, dtype=np.float64)
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    n = v.shape[-1] if v.ndim else None
    if mean.shape != (n,) or std.shape != (n,):
        raise ValueError(
            f"apply_norm: mean {mean.shape} and std {std.shape} must be 1-D, matching the last axis "
            f"of values {v.shape}"
        )
    if not (np.isfinite(std).all() and (std != 0).all()):
        raise ValueError(
            "apply_norm: std must be finite and non-zero (zero std is replaced by 1.0 at fit time)"
        )
    # In place after the subtraction: the same float64 operations without a second temporary.
    out = v - mean
    np.divide(out, std, out=out)
    return out.astype(np.float32)


