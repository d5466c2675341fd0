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
    n = ts.size
    if n == 0 or grid.size == 0:
        return np.full(grid.size, np.nan)
    a = grid - beat
    q = np.searchsorted(ts, grid, side="right") - 1  # the last kept point at or before g
    # The last kept point at or before g - beat: the row before's q where the rows are a beat
    # apart (consecutive grid rows, nearly always), else looked up.
    p = np.empty_like(q)
    p[1:] = q[:-1]
    looked = np.ones(grid.size, dtype=bool)
    looked[1:] = grid[:-1] != a[1:]
    p[looked] = np.searchsorted(ts, a[looked], side="right") - 1
    ok = p >= 0
    np.maximum(p, 0, out=p)
    np.maximum(q, 0, out=q)
    dt = np.diff(ts)
    # Segments longer than max_gap (few): a row is ok only if none lies between its p and q.
    long_gaps = np.flatnonzero(dt > max_gap)
    if long_gaps.size:
        ok &= np.searchsorted(long_gaps, p) == np.searchsorted(long_gaps, q)
    t_q, v_q = ts[q], value[q]
    seg_dt = dt.astype(np.float64)
    # Every row gets its three pieces computed; rows that are not ok are NaN at the end (cheaper
    # than gathering the ok rows first, as nearly all are).
    if linear:
        r = np.minimum(q + 1, n - 1)
        t_r, v_r = ts[r], value[r]
        has_next = r > q
        towards = has_next & (t_r - t_q <= max_gap)
        if causal_beat is not None:
            soon = has_next & (t_r - grid < causal_beat)
            ok &= (t_q == grid) | (towards & soon) | (~soon & (grid - t_q <= max_gap))
            towards &= soon
        else:
            ok &= (t_q == grid) | towards
        seg_area = np.empty(n)  # one more: reduceat's indices must be < len
        np.multiply((value[:-1] + value[1:]) * seg_dt, 0.5, out=seg_area[:-1])
    else:
        ok &= grid - t_q <= max_gap
        seg_area = np.empty(n)
        np.multiply(value[:-1], seg_dt, out=seg_area[:-1])
    seg_area[-1] = 0.0
    inside = p < q  # a kept point lies in (g - beat, g]

    # The whole segments p+1 .. q-1 between the interval's kept points, summed per row (a row
    # without one sums nothing: reduceat's answer for an empty range is masked).
    p1 = np.minimum(p + 1, n - 1)
    idx = np.empty(2 * grid.size, dtype=np.intp)
    idx[0::2], idx[1::2] = p1, q
    whole = np.add.reduceat(seg_area, idx)[::2]
    whole[q <= p1] = 0.0

    # From g - beat to the first kept point inside the interval (p < q), on segment p -> p + 1;
    # rows without one get nothing here (their values are discarded, so no warnings for them).
    t_a, t_b, v_a, v_b = ts[p], ts[p1], value[p], value[p1]
    span = (t_b - a).astype(np.float64)
    span[~inside] = 0.0
    if linear:
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = (a - t_a).astype(np.float64) / (t_b - t_a).astype(np.float64)
            first_piece = ((v_a + (v_b - v_a) * frac) + v_b) * span * 0.5
        first_piece[~inside] = 0.0
    else:
        first_piece = v_a * span

    # From max(g - beat, t_q) to g: a line towards q + 1, or the held value.
    s0 = np.where(inside, t_q, a)
    length = (grid - s0).astype(np.float64)
    if linear:
        denom = (t_r - t_q).astype(np.float64)
        denom[~towards] = 1.0
        slope = v_r - v_q
        slope[~towards] = 0.0
        f_s0 = v_q + slope * ((s0 - t_q).astype(np.float64) / denom)
        f_g = v_q + slope * ((grid - t_q).astype(np.float64) / denom)
        end_piece = (f_s0 + f_g) * length * 0.5
    else:
        end_piece = v_q * length
    out = (first_piece + whole + end_piece) / float(beat)
    out[~ok] = np.nan
    return out
