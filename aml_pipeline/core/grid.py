"""Alignment of cleaned points to the run's regular grid (docs/spec.md, the grid).

Grid times are ``ceil(start / beat) * beat + n * beat <= end`` in integer milliseconds, so every
run's grid is phase-locked to epoch multiples of the beat. Values are never extrapolated, and a gap
longer than ``max_interp_ms`` is never bridged: missing is NaN, and the window stage drops what
it cannot use.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from aml_pipeline.core.args import as_int
from aml_pipeline.core.grid_params import NodeGridParams


def grid_span(start_ms: int, end_ms: int, beat_ms: int) -> tuple[int, int]:
    """First grid time ``ceil(start / beat) * beat`` and the number of grid times up to ``end_ms``."""
    start, end, beat = as_int("start_ms", start_ms), as_int("end_ms", end_ms), as_int("beat_ms", beat_ms)
    if beat < 1:
        raise ValueError(f"grid_span: beat_ms must be >= 1, got {beat}")
    first = -(-start // beat) * beat  # exact integer ceil, also for negative start
    return first, (0 if first > end else (end - first) // beat + 1)


def align_linear(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_interp_ms: int) -> np.ndarray:
    """Exact hit, else linear interpolation between the neighbouring points if their gap <= max_interp_ms."""
    return _linear(*_check("align_linear", ts, value, grid, max_interp_ms))


def _linear(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_gap: int) -> np.ndarray:
    out = np.full(grid.size, np.nan)
    n = ts.size
    if n == 0 or grid.size == 0:
        return out
    r = np.searchsorted(ts, grid, side="left")  # ts[r] >= g
    r_c = np.minimum(r, n - 1)
    exact = (r < n) & (ts[r_c] == grid)
    out[exact] = value[r_c[exact]]
    # Strictly between two points: t_l < g < t_r; never before the first or after the last.
    between = ~exact & (r > 0) & (r < n)
    right = r[between]
    left = right - 1
    t_l, t_r = ts[left], ts[right]
    bridged = (t_r - t_l) <= max_gap
    left, right, t_l, t_r = left[bridged], right[bridged], t_l[bridged], t_r[bridged]
    g = grid[between][bridged]
    v_l, v_r = value[left], value[right]
    # int64 differences convert to float64 exactly (|dt| < 2**53 ms), as Python's int / int does.
    frac = (g - t_l).astype(np.float64) / (t_r - t_l).astype(np.float64)
    idx = np.flatnonzero(between)[bridged]
    out[idx] = v_l + (v_r - v_l) * frac
    return out


def align_hold(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_interp_ms: int) -> np.ndarray:
    """Last point at or before the grid time, if it is at most ``max_interp_ms`` old."""
    return _hold(*_check("align_hold", ts, value, grid, max_interp_ms))


def _hold(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_age: int) -> np.ndarray:
    out = np.full(grid.size, np.nan)
    if ts.size == 0 or grid.size == 0:
        return out
    last = np.searchsorted(ts, grid, side="right") - 1  # largest t_l <= g
    has = last >= 0
    last_c = np.maximum(last, 0)
    fresh = has & ((grid - ts[last_c]) <= max_age)
    out[fresh] = value[last_c[fresh]]
    return out


class GridAligner:
    """One node's kept points aligned onto a run's regular grid by the node's ``interp`` and
    ``max_interp_ms`` (:class:`~aml_pipeline.core.grid_params.NodeGridParams`), fed in chunks
    (bounded memory).

    The grid is ``first_ms + r * beat_ms`` for rows ``r = 0 .. n_rows - 1``. A row's value is final
    once a kept point at or after its time has been seen: linear interpolation then knows both
    neighbours and hold the last point before it. So each :meth:`feed` emits the rows up to its last
    point, carrying only that point (the left neighbour / held value) to the next chunk, and
    :meth:`finish` emits the rest (hold may still fill them; linear never extrapolates). Values are
    exactly :func:`align_linear`'s or :func:`align_hold`'s on the whole series, emitted in blocks of
    at most ``block_rows`` rows.
    """

    def __init__(
        self, first_ms: int, beat_ms: int, n_rows: int, params: NodeGridParams, *, block_rows: int = 1 << 16
    ) -> None:
        self.params = params
        self.first = as_int("first_ms", first_ms)
        self.beat = as_int("beat_ms", beat_ms)
        self.n_rows = as_int("n_rows", n_rows)
        self.block_rows = as_int("block_rows", block_rows)
        if self.beat < 1 or self.n_rows < 0 or self.block_rows < 1:
            raise ValueError(
                f"GridAligner: need beat_ms >= 1, n_rows >= 0, block_rows >= 1 "
                f"(got {self.beat}, {self.n_rows}, {self.block_rows})"
            )
        self.max_interp = params.max_interp_ms
        self._kernel = _linear if params.interp == "linear" else _hold
        self.next_row = 0  # first row not emitted yet
        self._prev_ts = np.empty(0, dtype=np.int64)  # the last kept point seen (0 or 1 of it)
        self._prev_value = np.empty(0, dtype=np.float64)

    def feed(self, ts: np.ndarray, value: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, values)`` blocks of the rows this chunk's points make final."""
        seg_ts = np.concatenate([self._prev_ts, _int_array("GridAligner", "ts", ts)])
        seg_value = np.concatenate([self._prev_value, np.asarray(value, dtype=np.float64)])
        if seg_ts.size == self._prev_ts.size:
            return
        _check("GridAligner", seg_ts, seg_value, np.empty(0, np.int64), self.max_interp)  # strictly increasing
        last = int(seg_ts[-1])
        stop = min(self.n_rows, max(0, (last - self.first) // self.beat + 1))
        yield from self._emit(stop, seg_ts, seg_value)
        self._prev_ts, self._prev_value = seg_ts[-1:], seg_value[-1:]

    def finish(self) -> Iterator[tuple[int, np.ndarray]]:
        """The remaining rows, after the last point."""
        yield from self._emit(self.n_rows, self._prev_ts, self._prev_value)

    def _emit(self, stop: int, seg_ts: np.ndarray, seg_value: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        kernel = self._kernel
        while self.next_row < stop:
            a = self.next_row
            b = min(stop, a + self.block_rows)
            grid = self.first + self.beat * np.arange(a, b, dtype=np.int64)
            # Only the points around the block's times can be its neighbours (checked once in feed).
            lo = max(0, int(np.searchsorted(seg_ts, grid[0], side="left")) - 1)
            hi = int(np.searchsorted(seg_ts, grid[-1], side="right")) + 1
            yield a, kernel(seg_ts[lo:hi], seg_value[lo:hi], grid, self.max_interp)
            self.next_row = b


def missing_ratio(column: np.ndarray) -> float:
    """Fraction of NaN in an aligned column; 1.0 for an empty grid (nothing usable was observed)."""
    column = np.asarray(column, dtype=np.float64)
    if column.size == 0:
        return 1.0
    return float(np.count_nonzero(np.isnan(column)) / column.size)


def _check(
    fn: str, ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_interp_ms: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    ts = _int_array(fn, "ts", ts)
    grid = _int_array(fn, "grid", grid)
    value = np.asarray(value, dtype=np.float64)
    if value.ndim != 1 or value.size != ts.size:
        raise ValueError(
            f"{fn}: value must be 1-D with the same length as ts ({ts.size}), got shape {value.shape}"
        )
    step_back = np.flatnonzero(np.diff(ts) <= 0)
    if step_back.size:
        i = int(step_back[0]) + 1
        raise ValueError(
            f"{fn}: ts must be strictly increasing (clean duplicates first); ts[{i - 1}] = {int(ts[i - 1])}, "
            f"ts[{i}] = {int(ts[i])}"
        )
    max_gap = as_int("max_interp_ms", max_interp_ms)
    if max_gap < 0:
        raise ValueError(f"{fn}: max_interp_ms must be >= 0, got {max_gap}")
    return ts, value, grid, max_gap


def _int_array(fn: str, name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{fn}: {name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{fn}: {name} must be integer epoch ms, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


