"""Run traces the run figure's tests draw: made by hand, each showing what a test looks for."""

from __future__ import annotations

import numpy as np

from aml_pipeline.core.traces import TraceAccumulator
from aml_pipeline.pipeline import run_figure as rf


def synthetic_traces(width: int = rf.PLOT_PX):
    """Two nodes over PLOT_PX seconds (800 s), the grid at 0.5 s (two rows per second): at the
    default width, one column per second.

    A: a sine with a gap (grid rows of 100..149 s all missing), one missing grid row at 300 s
    (a partly missing column) and one raw sentinel far below its range at 460.5 s (where the
    sine is near its top). B: a ramp 0..10 with one removed outlier at 450 s, value 20 (above
    its range).
    """
    t0, t1 = 0, rf.PLOT_PX * 1000 - 1
    acc = TraceAccumulator(t0, t1, ["A", "B"], width=width)
    grid_ts = np.arange(0, t1 + 1, 500, dtype=np.int64)
    a = np.sin(grid_ts / 60_000)
    a[(grid_ts >= 100_000) & (grid_ts < 150_000)] = np.nan
    a[grid_ts == 300_500] = np.nan
    b = np.linspace(0, 10, grid_ts.size)
    acc.add_grid(None, grid_ts, np.column_stack([a, b]))
    raw_ts = np.arange(200, t1 + 1, 1000, dtype=np.int64)
    acc.add_raw(0, np.r_[raw_ts, 460_500], np.r_[np.sin(raw_ts / 60_000), -9999.0])
    acc.add_raw(1, raw_ts, np.interp(raw_ts, grid_ts, b))
    acc.add_removed(1, np.array([450_000]), np.array([20.0]))
    return acc.result()


def constant_nodes(n: int):
    """``n`` nodes over an hour, node i at value i with its grid missing in columns 20 i .. 20 i + 9."""
    nodes = [f"N{i:02d}" for i in range(n)]
    acc = TraceAccumulator(0, 3_599_999, nodes)
    grid_ts = np.arange(0, 3_600_000, 900, dtype=np.int64)
    grid = np.tile(np.arange(n, dtype=np.float64), (grid_ts.size, 1))
    col = grid_ts * rf.PLOT_PX // 3_600_000
    for i in range(n):
        grid[(col >= 20 * i) & (col < 20 * i + 10), i] = np.nan
    acc.add_grid(None, grid_ts, grid)
    return acc.result()
