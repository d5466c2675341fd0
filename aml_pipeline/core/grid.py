"""Alignment of cleaned points to the run's regular grid (docs/spec.md, the grid).

Grid times are ``ceil(start / beat) * beat + n * beat <= end`` in integer milliseconds, so every
run's grid is phase-locked to epoch multiples of the beat. Values are never extrapolated, and a gap
longer than ``max_interp_ms`` is never bridged: missing is NaN, and the window stage drops what
it cannot use.

A row takes the value at its grid time (``aggregate: point``) or the time-weighted mean over the
beat that ends at it (``aggregate: mean``) of the function the node's ``interp`` defines between
its kept points: linear (trapezoids, TimescaleDB Toolkit's ``time_weight('Linear')`` with
``interpolated_average``) or hold (last observation carried forward, ``'LOCF'``). In a causal
dataset a row depends only on points before the next grid time (docs/spec.md, causal).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from aml_pipeline.core.aggregate import mean_hold, mean_linear
from aml_pipeline.core.args import as_int
from aml_pipeline.core.grid_params import NodeGridParams


def grid_span(start_ms: int, end_ms: int, beat_ms: int) -> tuple[int, int]:
    """First grid time ``ceil(start / beat) * beat`` and the number of grid times up to ``end_ms``."""
    start, end, beat = as_int("start_ms", start_ms), as_int("end_ms", end_ms), as_int("beat_ms", beat_ms)
    if beat < 1:
        raise ValueError(f"grid_span: beat_ms must be >= 1, got {beat}")
    first = -(-start // beat) * beat  # exact integer ceil, also for negative start
    return first, (0 if first > end else (end - first) // beat + 1)


def align_linear(
    ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_interp_ms: int, *, causal_beat_ms: int | None = None
) -> np.ndarray:
    """Exact hit, else linear interpolation between the neighbouring points if their gap <= max_interp_ms.

    ``causal_beat_ms``: interpolate only towards a point less than that after the grid time; a
    grid time whose next point is later (or absent) holds the last point if it is at most
    ``max_interp_ms`` old.
    """
    return _linear(*_check("align_linear", ts, value, grid, max_interp_ms), causal_beat_ms)


def _linear(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_gap: int, causal_beat: int | None = None) -> np.ndarray:
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
    if causal_beat is not None:
        # The next point must come before the next grid time; if it does not (or never comes),
        # the row holds the last point, as a live system one beat later knows it.
        soon = (r < n) & (ts[r_c] - grid < causal_beat)  # exact hits included
        held = (r > 0) & ~soon
        last = r[held] - 1
        fresh = grid[held] - ts[last] <= max_gap
        out[np.flatnonzero(held)[fresh]] = value[last[fresh]]
        between &= soon
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
    """One node's kept points aligned onto a run's regular grid by the node's ``interp``,
    ``max_interp_ms``, ``aggregate`` and ``causal``
    (:class:`~aml_pipeline.core.grid_params.NodeGridParams`), fed in chunks (bounded memory).

    The grid is ``first_ms + r * beat_ms`` for rows ``r = 0 .. n_rows - 1``. A row's value is final
    once a kept point at or after its time has been seen: linear interpolation then knows both
    neighbours and hold the last point before it. So each :meth:`feed` emits the rows up to its last
    point, carrying to the next chunk only the points a later row can still use (point values: the
    last one, the left neighbour or held value; means: those from the last point at or before the
    next row's interval on), and :meth:`finish` emits the rest (hold may still fill them; linear
    never extrapolates). Values are exactly :func:`align_linear`'s, :func:`align_hold`'s or the
    :mod:`~aml_pipeline.core.aggregate` kernels' on the whole series, emitted in blocks of at most
    ``block_rows`` rows.
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
        self._kernel = _kernel(params, self.beat)
        # How far before a row's time its value reaches: a mean covers the beat before it.
        self._reach = self.beat if params.aggregate == "mean" else 0
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
        # The next row's value starts at the last point at or before its reach (the last point
        # for point values: every later row lies after it).
        next_time = self.first + self.beat * self.next_row - self._reach
        keep = min(seg_ts.size - 1, max(0, int(np.searchsorted(seg_ts, next_time, side="right")) - 1))
        self._prev_ts, self._prev_value = seg_ts[keep:], seg_value[keep:]

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
            lo = max(0, int(np.searchsorted(seg_ts, grid[0] - self._reach, side="left")) - 1)
            hi = int(np.searchsorted(seg_ts, grid[-1], side="right")) + 1
            yield a, kernel(seg_ts[lo:hi], seg_value[lo:hi], grid, self.max_interp)
            self.next_row = b


# Grid cells per call of a point kernel over long series: its temporaries (about twenty arrays of
# 8 bytes a cell) stay in the CPU cache and below glibc's mmap threshold, where each new array of
# a whole run would be a fresh mapping whose page faults cost more than its arithmetic.
_ALIGN_BLOCK_CELLS = 1 << 13


def align_batch(
    ts: np.ndarray, value: np.ndarray, starts: np.ndarray, params: Sequence[NodeGridParams],
    first_ms: int, beat_ms: int, n_rows: int,
) -> np.ndarray:
    """Several series' kept points (back to back, series ``i`` rows ``starts[i] .. starts[i+1]-1``,
    each strictly increasing) aligned onto one grid of ``n_rows`` times from ``first_ms``, each by
    its own ``params[i]``: ``[series, n_rows]``, the values :class:`GridAligner` gives each series.

    Point values (``aggregate: point``) come from a count of each series' points per grid row
    (:func:`_points_before`), which gives every row's neighbours among its own series' points, and
    the point kernels' arithmetic on them (:func:`_linear_at`, :func:`_hold_at`): short series all
    in one call, long ones series by series in blocks of rows. The series sharing a mean kernel (``interp``, ``causal``, ``max_interp_ms``) go through it in one
    call: each series and its grid are moved to a time span of their own, far enough apart that no
    gap between two series is ever bridged. The kernels use only differences of times, so the
    values are those of each series alone, bit for bit.
    """
    first, beat, rows = as_int("first_ms", first_ms), as_int("beat_ms", beat_ms), as_int("n_rows", n_rows)
    ts = _int_array("align_batch", "ts", ts)
    value = np.asarray(value, dtype=np.float64)
    bounds = np.append(np.asarray(starts, dtype=np.int64), ts.size)
    if bounds.size - 1 != len(params) or (bounds.size and bounds[0] != 0) or np.any(np.diff(bounds) < 0):
        raise ValueError(f"align_batch: starts must ascend from 0, one per series ({len(params)} params)")
    if beat < 1:
        raise ValueError(f"align_batch: beat_ms must be >= 1, got {beat}")
    out = np.full((len(params), rows), np.nan)
    if rows == 0 or not len(params):
        return out
    if value.ndim != 1 or value.size != ts.size:
        raise ValueError(f"align_batch: value must be 1-D with the same length as ts ({ts.size}), got shape {value.shape}")
    step_back = np.flatnonzero(ts[1:] <= ts[:-1])
    if step_back.size:  # a series' first point may precede the last one's
        # A search of the ascending bounds: np.isin's setup costs more than the few steps back.
        at = np.minimum(np.searchsorted(bounds, step_back + 1), bounds.size - 1)
        step_back = step_back[bounds[at] != step_back + 1]
    if step_back.size:
        i = int(step_back[0]) + 1
        raise ValueError(f"align_batch: ts must be strictly increasing within a series (clean duplicates first); "
                         f"ts[{i - 1}] = {int(ts[i - 1])}, ts[{i}] = {int(ts[i])}")
    grid = first + beat * np.arange(rows, dtype=np.int64)
    groups: dict[tuple[str, str, bool, int], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.interp, p.aggregate, p.causal, p.max_interp_ms), []).append(i)
    lo = min(int(ts.min()) if ts.size else first, first - beat)
    hi = max(int(ts.max()) if ts.size else first, int(grid[-1]))
    for (interp, aggregate, causal, max_gap), members in groups.items():
        if max_gap < 0:
            raise ValueError(f"align_batch: max_interp_ms must be >= 0, got {max_gap}")
        if aggregate != "mean":
            if not ts.size:
                continue
            def point_kernel(r, a, b, g, interp=interp, causal=causal, max_gap=max_gap):
                if interp == "linear":
                    return _linear_at(ts, value, g, r, a, b, max_gap, beat if causal else None)
                return _hold_at(ts, value, g, r, a, b, max_gap)

            parts = [(int(bounds[j]), int(bounds[j + 1])) for j in members]
            if rows * len(members) <= _ALIGN_BLOCK_CELLS:  # short series (a live input): all in one call
                m = np.asarray(members)
                out[m] = point_kernel(_points_before(ts, parts, first, beat, rows), bounds[m][:, None], bounds[m + 1][:, None], grid)
                continue
            for j, (a, b) in zip(members, parts):  # series by series, in blocks of rows
                r = _points_before(ts, [(a, b)], first, beat, rows)[0]
                for i0 in range(0, rows, _ALIGN_BLOCK_CELLS):
                    i1 = min(rows, i0 + _ALIGN_BLOCK_CELLS)
                    out[j, i0:i1] = point_kernel(r[i0:i1], a, b, grid[i0:i1])
            continue
        span = hi - lo + 2 * (max_gap + beat) + 1  # wider than any gap a kernel may bridge or look back
        if span * len(members) >= 1 << 62:
            raise ValueError("align_batch: the series span too long a time to be aligned together")
        parts = [(int(bounds[i]), int(bounds[i + 1])) for i in members]
        shift = np.repeat(np.arange(len(members), dtype=np.int64) * span - lo, [b - a for a, b in parts])
        seg_ts = np.concatenate([ts[a:b] for a, b in parts]) + shift
        seg_value = np.concatenate([value[a:b] for a, b in parts])
        seg_grid = (grid - lo + (np.arange(len(members), dtype=np.int64) * span)[:, None]).ravel()
        out[members] = _kernel(params[members[0]], beat)(seg_ts, seg_value, seg_grid, max_gap).reshape(len(members), rows)
    return out


def _points_before(ts: np.ndarray, parts: Sequence[tuple[int, int]], first: int, beat: int, rows: int) -> np.ndarray:
    """``[len(parts), rows]``: for each series ``ts[a:b]`` (ascending) of ``parts`` and each grid
    time ``g`` of ``rows`` from ``first``, the index in ``ts`` of the series' first point at or
    after ``g`` (``b`` if none): ``a + np.searchsorted(ts[a:b], g)``.

    A point at ``t`` comes before grid row ``i`` (``t < first + i * beat``) exactly when
    ``(t - first) // beat + 1 <= i``, so counting each series' points per that row and summing the
    counts gives every row's index in one pass over the points, with no search per row."""
    key = (ts[parts[0][0] : parts[0][1]] if len(parts) == 1 else np.concatenate([ts[a:b] for a, b in parts])) - first
    key //= beat
    key += 1
    np.clip(key, 0, rows, out=key)  # before the grid: before every row; after it: before none
    if len(parts) > 1:
        key += np.repeat(np.arange(len(parts), dtype=np.int64) * (rows + 1), [b - a for a, b in parts])
    counts = np.bincount(key, minlength=len(parts) * (rows + 1)).reshape(len(parts), rows + 1)[:, :rows]
    r = np.cumsum(counts, axis=1)
    r += np.array([a for a, _ in parts], dtype=np.int64)[:, None]
    return r


def _linear_at(
    ts: np.ndarray, value: np.ndarray, grid: np.ndarray, r: np.ndarray, a: np.ndarray, b: np.ndarray, max_gap: int,
    causal_beat: int | None,
) -> np.ndarray:
    """:func:`_linear` of each series ``ts[a:b]`` (rows of ``r``, ``a``, ``b``) on ``grid``, given
    ``r`` (:func:`_points_before`): the same operations on the same values, row by row."""
    n = ts.size
    right = np.minimum(r, n - 1)
    left = np.maximum(r - 1, 0)
    t_r, t_l = ts[right], ts[left]
    v_r, v_l = value[right], value[left]
    has_r, has_l = r < b, r > a
    exact = t_r == grid
    exact &= has_r
    # Strictly between two points of the series: t_l < g < t_r; never before the first or after the last.
    between = has_l & has_r
    between &= ~exact
    if causal_beat is not None:
        # The next point must come before the next grid time; if it does not (or never comes),
        # the row holds the last point, as a live system one beat later knows it.
        soon = has_r & (t_r - grid < causal_beat)  # exact hits included
        held = has_l & ~soon & (grid - t_l <= max_gap)
        between &= soon
    dt = t_r - t_l
    between &= dt <= max_gap
    # Every cell computed, the ones not between two bridged points discarded: the same IEEE
    # operations on the same operands as on the between cells alone. int64 differences convert
    # to float64 exactly (|dt| < 2**53 ms), as Python's int / int does.
    with np.errstate(all="ignore"):
        frac = (grid - t_l).astype(np.float64)
        frac /= dt.astype(np.float64)
        out = v_r - v_l
        out *= frac
        out += v_l
    np.copyto(out, v_r, where=exact)
    if causal_beat is not None:
        np.copyto(out, v_l, where=held)
        between |= held
    between |= exact
    out[~between] = np.nan
    return out


def _hold_at(
    ts: np.ndarray, value: np.ndarray, grid: np.ndarray, r: np.ndarray, a: np.ndarray, b: np.ndarray, max_age: int,
) -> np.ndarray:
    """:func:`_hold` of each series ``ts[a:b]`` on ``grid``, given ``r`` (:func:`_points_before`)."""
    n = ts.size
    right = np.minimum(r, n - 1)
    last = r + ((r < b) & (ts[right] == grid)) - 1  # the last point at or before g: an exact hit, else r's left
    has = last >= a
    np.maximum(last, 0, out=last)
    fresh = has & ((grid - ts[last]) <= max_age)
    return np.where(fresh, value[last], np.nan)


def _kernel(params: NodeGridParams, beat: int):
    """The whole-series kernel ``(ts, value, grid, max_gap) -> values`` of a node's alignment."""
    causal_beat = beat if params.causal else None
    if params.aggregate == "mean":
        if params.interp == "linear":
            return lambda ts, value, grid, max_gap: mean_linear(ts, value, grid, max_gap, beat, causal_beat)
        return lambda ts, value, grid, max_gap: mean_hold(ts, value, grid, max_gap, beat)
    if params.interp == "linear":
        return lambda ts, value, grid, max_gap: _linear(ts, value, grid, max_gap, causal_beat)
    return _hold  # the last point at or before the grid time: causal as it is


class SamplePeriods:
    """The median interval between consecutive points of a series fed in chunks, for telling a
    node sampled faster than the grid's beat (whose points between grid times point values would
    ignore). Intervals shorter than ``cap_ms`` (at most :data:`MAX_PERIOD_BINS` ms) are counted per
    millisecond and longer ones only counted, so memory is bounded whatever the series' length, and
    the median is exact (numpy's: the middle two averaged for an even count) whenever the middle
    intervals are below the cap."""

    MAX_PERIOD_BINS = 1 << 20

    def __init__(self, cap_ms: int) -> None:
        self.cap = min(as_int("cap_ms", cap_ms), self.MAX_PERIOD_BINS)
        self._last: int | None = None
        self._counts = np.zeros(0, dtype=np.int64)  # per interval in ms below the cap, grown as needed
        self.intervals = 0

    def feed(self, ts: np.ndarray) -> None:
        ts = np.asarray(ts, dtype=np.int64)
        if not ts.size:
            return
        d = np.diff(ts) if self._last is None else np.diff(ts, prepend=self._last)
        self._last = int(ts[-1])
        self.intervals += int(d.size)
        short = d[d < self.cap]
        if short.size:
            counts = np.bincount(short)
            if counts.size > self._counts.size:
                self._counts = np.concatenate([self._counts, np.zeros(counts.size - self._counts.size, np.int64)])
            self._counts[: counts.size] += counts

    @property
    def median_ms(self) -> float | None:
        """The median interval in ms; None without intervals or when a middle one is not below the cap."""
        n = self.intervals
        if n == 0:
            return None
        cum = np.cumsum(self._counts)
        hi = n // 2  # the middle element(s): (n - 1) // 2 and n // 2
        if not cum.size or cum[-1] <= hi:
            return None
        lo_value = int(np.searchsorted(cum, (n - 1) // 2, side="right"))
        hi_value = int(np.searchsorted(cum, hi, side="right"))
        return (lo_value + hi_value) / 2.0


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


