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


def hampel_reference(x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0) -> np.ndarray:
    """Per-point Hampel filter: True where ``|x_i - m_i| > max(sigma * 1.4826 * MAD_i, min_dev)``."""
    xs = [float(v) for v in np.asarray(x, dtype=np.float64)]
    n = len(xs)
    flags = np.zeros(n, dtype=bool)
    if k == 0:
        return flags
    for i in range(n):
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
    ts: Sequence[int], value: Sequence[float], grid: Sequence[int], max_interp_ms: int
) -> np.ndarray:
    ts_l = [int(t) for t in ts]
    vs = [float(v) for v in value]
    out = np.full(len(grid), np.nan)
    for g_i, g in enumerate(int(g) for g in grid):
        j = bisect.bisect_left(ts_l, g)
        if j < len(ts_l) and ts_l[j] == g:
            out[g_i] = vs[j]
            continue
        if j == 0 or j == len(ts_l):
            continue  # never extrapolate
        t_l, t_r, v_l, v_r = ts_l[j - 1], ts_l[j], vs[j - 1], vs[j]
        if t_r - t_l <= max_interp_ms:
            out[g_i] = v_l + (v_r - v_l) * ((g - t_l) / (t_r - t_l))
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
