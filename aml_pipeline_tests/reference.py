"""Straightforward, loop-based reference implementations of the core semantics (DESIGN 4).

They are written to be obviously right, not fast: one Python loop per point / grid row / window,
directly following the wording of the design. Tests compare the vectorised core against them, and
the benchmark times ``hampel_reference`` against ``aml_pipeline.core.hampel.hampel_outliers``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def _median(values: list[float]) -> float:
    """numpy median semantics: the middle value, or the mean ``(a + b) / 2`` of the middle two."""
    s = sorted(values)
    n = len(s)
    mid = n // 2
    if n % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2.0


def hampel_reference(x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0, *, trailing: bool = False) -> np.ndarray:
    """Per-point Hampel filter: True where ``|x_i - m_i| > max(sigma * 1.4826 * MAD_i, min_dev)``;
    the window is ``i-k..i+k`` (clipped) and ``m_i`` its median, or with ``trailing`` the window
    is ``i-2k..i`` (clipped at 0) and ``m_i`` the median of its newest half ``i-k..i`` (at least
    its newest three points)."""
    xs = [float(v) for v in np.asarray(x, dtype=np.float64)]
    n = len(xs)
    flags = np.zeros(n, dtype=bool)
    if k == 0:
        return flags
    for i in range(n):
        if trailing:
            window = xs[max(0, i - 2 * k) : i + 1]
            m = _median(xs[max(0, i - max(3, k + 1) + 1) : i + 1])
        else:
            window = xs[max(0, i - k) : min(n - 1, i + k) + 1]
            m = _median(window)
        mad = _median([abs(v - m) for v in window])
        threshold = max(sigma * 1.4826 * mad, min_dev)
        flags[i] = abs(xs[i] - m) > threshold
    return flags


def hampel_reference_numpy(x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0) -> np.ndarray:
    """The same filter written with ``np.median`` itself (slow; ties the reference to numpy)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    flags = np.zeros(n, dtype=bool)
    if k == 0:
        return flags
    for i in range(n):
        window = x[max(0, i - k) : min(n - 1, i + k) + 1]
        m = np.median(window)
        mad = np.median(np.abs(window - m))
        flags[i] = abs(x[i] - m) > max(sigma * 1.4826 * mad, min_dev)
    return flags


def align_linear_reference(
    ts: Sequence[int], value: Sequence[float], grid: Sequence[int], max_interp_ms: int,
    causal_beat_ms: int | None = None,
) -> np.ndarray:
    """Exact hit, else interpolation between the neighbours within the gap limit; causal: only
    towards a neighbour less than a beat after the grid time, else the last point held."""
    ts_l = [int(t) for t in ts]
    vs = [float(v) for v in value]
    out = np.full(len(grid), np.nan)
    for g_i, g in enumerate(int(g) for g in grid):
        j = bisect.bisect_left(ts_l, g)
        if j < len(ts_l) and ts_l[j] == g:
            out[g_i] = vs[j]
            continue
        if j == 0:
            continue  # never extrapolate
        if causal_beat_ms is not None and (j == len(ts_l) or ts_l[j] - g >= causal_beat_ms):
            if g - ts_l[j - 1] <= max_interp_ms:
                out[g_i] = vs[j - 1]
            continue
        if j == len(ts_l):
            continue
        t_l, t_r, v_l, v_r = ts_l[j - 1], ts_l[j], vs[j - 1], vs[j]
        if t_r - t_l <= max_interp_ms:
            out[g_i] = v_l + (v_r - v_l) * ((g - t_l) / (t_r - t_l))
    return out


def mean_reference(
    ts: Sequence[int], value: Sequence[float], grid: Sequence[int], max_interp_ms: int, beat_ms: int,
    interp: str, causal_beat_ms: int | None = None,
) -> np.ndarray:
    """The time-weighted mean over ``(g - beat, g]`` of the node's function, integrated exactly
    (rational arithmetic), one grid time and one piece between consecutive points at a time; the
    row is missing where the function is undefined anywhere on the interval."""
    from fractions import Fraction

    ts_l = [int(t) for t in ts]
    vs = [Fraction(float(v)) for v in value]
    n = len(ts_l)
    out = np.full(len(grid), np.nan)

    def line(j: int, s: Fraction) -> Fraction:
        return vs[j] + (vs[j + 1] - vs[j]) * (s - ts_l[j]) / (ts_l[j + 1] - ts_l[j])

    def linear_at(s: Fraction, g: int) -> Fraction | None:
        """The interpolant at s in [g - beat, g], as the row at g knows it."""
        last = bisect.bisect_right(ts_l, g) - 1
        if last >= 0 and s > ts_l[last]:  # after the last point at or before g
            nxt_soon = last + 1 < n and (causal_beat_ms is None or ts_l[last + 1] - g < causal_beat_ms)
            if causal_beat_ms is not None and not nxt_soon:
                return vs[last] if g - ts_l[last] <= max_interp_ms else None
            if last + 1 == n or ts_l[last + 1] - ts_l[last] > max_interp_ms:
                return None
            return line(last, s)
        j = bisect.bisect_right(ts_l, s) - 1
        if j < 0:
            return None
        if ts_l[j] == s:
            return vs[j]
        if ts_l[j + 1] - ts_l[j] > max_interp_ms:
            return None
        return line(j, s)

    for g_i, g in enumerate(int(g) for g in grid):
        a = g - beat_ms
        cuts = [a, *(t for t in ts_l if a < t < g), g]
        total = Fraction(0)
        for lo, hi in zip(cuts, cuts[1:]):
            if interp == "hold":
                j = bisect.bisect_right(ts_l, lo) - 1  # constant on [lo, hi)
                if j < 0 or hi - ts_l[j] > max_interp_ms:
                    break
                total += vs[j] * (hi - lo)
            else:
                ends = [linear_at(Fraction(x), g) for x in (lo, Fraction(lo + hi, 2), hi)]
                if None in ends:
                    break
                total += (ends[0] + ends[2]) * (hi - lo) / 2
        else:
            out[g_i] = float(total / beat_ms)
    return out


def align_hold_reference(
    ts: Sequence[int], value: Sequence[float], grid: Sequence[int], max_interp_ms: int
) -> np.ndarray:
    ts_l = [int(t) for t in ts]
    vs = [float(v) for v in value]
    out = np.full(len(grid), np.nan)
    for g_i, g in enumerate(int(g) for g in grid):
        j = bisect.bisect_right(ts_l, g) - 1
        if j >= 0 and g - ts_l[j] <= max_interp_ms:
            out[g_i] = vs[j]
    return out


def windows_reference(
    grid: np.ndarray,
    history: int,
    horizon: int,
    stride: int,
    control_cols: Sequence[int],
    target_cols: Sequence[int],
) -> tuple[list[int], list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Window starts and the explicit x/u/y of each kept window (a window with any NaN it uses is dropped)."""
    T = grid.shape[0]
    starts: list[int] = []
    xs: list[np.ndarray] = []
    us: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    t = history
    while t <= T - horizon:
        x = grid[t - history : t, :]
        u = grid[t : t + horizon, list(control_cols)]
        y = grid[t : t + horizon, list(target_cols)]
        if not (np.isnan(x).any() or np.isnan(u).any() or np.isnan(y).any()):
            starts.append(t)
            xs.append(x.copy())
            us.append(u.copy())
            ys.append(y.copy())
        t += stride
    return starts, xs, us, ys


def window_timestamps_reference(grid_ts: Sequence[int], starts: Sequence[int], history: int, horizon: int) -> np.ndarray:
    """The grid timestamps of rows ``t-H..t+F-1`` of every window start ``t``: ``[N, H+F]``."""
    rows = [[int(grid_ts[t + i]) for i in range(-history, horizon)] for t in starts]
    return np.array(rows, dtype=np.int64).reshape(len(rows), history + horizon)


def window_mean_std_reference(windows: Sequence[np.ndarray], n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Population mean/std per column over explicitly materialised ``[steps, cols]`` windows."""
    rows = [w.reshape(-1, n_cols) for w in windows]
    stacked = np.concatenate(rows, axis=0) if rows else np.empty((0, n_cols))
    return stacked.mean(axis=0), stacked.std(axis=0)
