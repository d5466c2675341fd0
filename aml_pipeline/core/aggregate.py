"""Time-weighted means over the beat that ends at each grid time (``aggregate: mean``, docs/spec.md).

A grid row at ``g`` takes ``(1 / beat) * integral over (g - beat, g] of f``, where ``f`` is the
function the node's ``interp`` defines between its kept points:

* ``linear``: the straight line between consecutive kept points (the trapezoid rule, as
  TimescaleDB Toolkit's ``interpolated_average`` of ``time_weight('Linear')``);
* ``hold``: each kept value until the next point (last observation carried forward, ``'LOCF'``).

The gap rule is the point alignment's: the row is missing wherever ``f`` is undefined on the
interval, that is when a gap longer than ``max_interp_ms`` between consecutive kept points
touches it, when no kept point lies at or before ``g - beat``, and (linear) when no point at or
after ``g`` bridges its end; a held value older than ``max_interp_ms`` at ``g`` is missing too.
With ``causal_beat`` (a causal dataset) the line towards the first point after ``g`` is used only
when that point comes less than a beat after ``g``; otherwise the last value is held from the last
kept point to ``g`` (within ``max_interp_ms``), as for point values.

Each row's integral is three pieces: from ``g - beat`` to the first kept point inside the interval,
the whole segments between the interval's kept points, and from its last kept point to ``g``. The
whole segments are summed per row with ``np.add.reduceat`` over the segment areas, a sum whose
result depends only on the segments it adds, not on where they sit in the array, so the value is
the same whichever chunk or live read the points arrive in. No Python loop per point or row.
"""

from __future__ import annotations

import numpy as np


def mean_linear(
    ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_gap: int, beat: int, causal_beat: int | None = None
) -> np.ndarray:
    """Time-weighted mean of the linear interpolant over ``(g - beat, g]`` for each grid time ``g``;
    ``ts`` strictly increasing int64, ``grid`` int64."""
    return _mean(ts, value, grid, max_gap, beat, causal_beat, linear=True)


def mean_hold(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_gap: int, beat: int) -> np.ndarray:
    """Time-weighted mean of the held (LOCF) values over ``(g - beat, g]`` for each grid time ``g``."""
    return _mean(ts, value, grid, max_gap, beat, None, linear=False)


def _mean(
    ts: np.ndarray, value: np.ndarray, grid: np.ndarray, max_gap: int, beat: int, causal_beat: int | None,
    *, linear: bool,
) -> np.ndarray:
    out = np.full(grid.size, np.nan)
    n = ts.size
    if n == 0 or grid.size == 0:
        return out
    a = grid - beat
    first_of = np.searchsorted(ts, a, side="right") - 1  # P: the last kept point at or before g - beat
    last_of = np.searchsorted(ts, grid, side="right") - 1  # L: the last kept point at or before g
    # Gaps longer than max_gap between consecutive points, counted by prefix sums (exact integers).
    dt = np.diff(ts)
    long_gaps = np.concatenate([[0], np.cumsum(dt > max_gap)])
    ok = first_of >= 0
    p, q = np.maximum(first_of, 0), np.maximum(last_of, 0)
    ok &= long_gaps[q] == long_gaps[p]
    t_last, v_last = ts[q], value[q]
    # The end piece, from max(g - beat, t_L) to g: a line towards R = L + 1, or the held value.
    r = np.minimum(q + 1, n - 1)
    has_next = q + 1 < n
    at_g = t_last == grid
    if linear:
        towards = has_next & (ts[r] - t_last <= max_gap)
        if causal_beat is not None:
            soon = has_next & (ts[r] - grid < causal_beat)
            hold = ~soon & (grid - t_last <= max_gap)
            towards &= soon
        else:
            hold = np.zeros(grid.size, dtype=bool)
        ok &= at_g | towards | hold
    else:
        hold = grid - t_last <= max_gap
        towards = np.zeros(grid.size, dtype=bool)
        ok &= hold
    rows = np.flatnonzero(ok)
    if not rows.size:
        return out
    a, g = a[rows], grid[rows]
    p, q, r = p[rows], q[rows], r[rows]
    towards, at_g = towards[rows], at_g[rows]
    t_last, v_last = t_last[rows], v_last[rows]
    inside = p < q  # a kept point lies in (g - beat, g]

    # Whole segments p+1 .. q-1 (between the interval's kept points), summed per row.
    seg_dt = dt.astype(np.float64)
    if linear:
        seg_area = (value[:-1] + value[1:]) * seg_dt * 0.5
    else:
        seg_area = value[:-1] * seg_dt
    start, stop = p + 1, q
    whole = np.zeros(rows.size)
    some = stop > start
    if some.any():
        padded = np.append(seg_area, 0.0)  # reduceat's indices must be < len
        idx = np.column_stack([start[some], stop[some]]).ravel()
        whole[some] = np.add.reduceat(padded, idx)[::2]

    # From g - beat to the first kept point inside the interval (rows with one).
    first_piece = np.zeros(rows.size)
    if inside.any():
        i = p[inside]
        t_a, t_b, v_a, v_b = ts[i], ts[i + 1], value[i], value[i + 1]
        span = (t_b - a[inside]).astype(np.float64)
        if linear:
            frac = (a[inside] - t_a).astype(np.float64) / (t_b - t_a).astype(np.float64)
            f_a = v_a + (v_b - v_a) * frac
            first_piece[inside] = (f_a + v_b) * span * 0.5
        else:
            first_piece[inside] = v_a * span

    # From max(g - beat, t_L) to g.
    s0 = np.where(inside, t_last, a)
    length = (g - s0).astype(np.float64)
    if linear:
        t_r, v_r = ts[r], value[r]
        denom = np.where(towards, t_r - t_last, 1).astype(np.float64)
        slope = np.where(towards, v_r - v_last, 0.0)
        f_s0 = np.where(towards, v_last + slope * ((s0 - t_last).astype(np.float64) / denom), v_last)
        f_g = np.where(towards, v_last + slope * ((g - t_last).astype(np.float64) / denom), v_last)
        end_piece = np.where(at_g, 0.0, (f_s0 + f_g) * length * 0.5)
    else:
        end_piece = v_last * length
    out[rows] = (first_piece + whole + end_piece) / float(beat)
    return out
