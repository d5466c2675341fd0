from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.windows import StartFinder, explain_no_windows, window_block
from aml_pipeline_tests.core.whole_series import window_starts
from aml_pipeline_tests.reference import window_timestamps_reference, windows_reference

# Columns: 0 = feature, 1 = control, 2 = target.
CTRL, TGT = [1], [2]


def _explain(g: np.ndarray, names: list[str]) -> str:
    return explain_no_windows(g.shape[0], 3, 2, np.count_nonzero(np.isnan(g), axis=0), names)


def _grid(T: int, nodes: int = 3) -> np.ndarray:
    return np.arange(T * nodes, dtype=np.float64).reshape(T, nodes)


def test_starts_run_from_h_to_t_minus_f() -> None:
    assert window_starts(_grid(10), 3, 2, 1, CTRL, TGT).tolist() == [3, 4, 5, 6, 7, 8]
    assert window_starts(_grid(10), 3, 2, 1, CTRL, TGT).dtype == np.int64


def test_stride_steps_from_h() -> None:
    assert window_starts(_grid(10), 3, 2, 2, CTRL, TGT).tolist() == [3, 5, 7]
    assert window_starts(_grid(10), 3, 2, 5, CTRL, TGT).tolist() == [3, 8]
    assert window_starts(_grid(10), 3, 2, 100, CTRL, TGT).tolist() == [3]


def test_run_exactly_h_plus_f_has_one_window_shorter_has_none() -> None:
    assert window_starts(_grid(5), 3, 2, 1, CTRL, TGT).tolist() == [3]
    assert window_starts(_grid(4), 3, 2, 1, CTRL, TGT).size == 0
    assert window_starts(_grid(0), 3, 2, 1, CTRL, TGT).size == 0
    reason = _explain(_grid(4), ["TI101", "FIC200", "TI300"])
    assert reason == "run has 4 grid rows, fewer than historySteps + horizonSteps = 5"


def test_nan_in_history_drops_every_window_that_reads_it() -> None:
    g = _grid(12)
    g[5, 0] = np.nan  # feature, row 5: history of windows t = 6..8 (H = 3)
    assert window_starts(g, 3, 2, 1, CTRL, TGT).tolist() == [3, 4, 5, 9, 10]


def test_nan_in_a_feature_future_does_not_drop_a_window() -> None:
    g = _grid(12)
    g[10, 0] = np.nan  # only in the future part of windows t = 9, 10 for the feature
    starts = window_starts(g, 3, 2, 1, CTRL, TGT)
    assert starts.tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    x, u, y = gather_windows(g, starts, 3, 2, CTRL, TGT)
    assert np.isfinite(x).all() and np.isfinite(u).all() and np.isfinite(y).all()


@pytest.mark.parametrize("col", [1, 2])
def test_nan_in_a_control_or_target_future_drops_the_window(col: int) -> None:
    g = _grid(12)
    g[10, col] = np.nan  # future of t = 9, 10; history of t = 11 (beyond T - F = 10)
    assert window_starts(g, 3, 2, 1, CTRL, TGT).tolist() == [3, 4, 5, 6, 7, 8]


def test_node_with_no_data_leaves_no_window_and_is_named() -> None:
    g = _grid(50)
    g[:, 0] = np.nan
    g[:6, 2] = np.nan
    assert window_starts(g, 3, 2, 1, CTRL, TGT).size == 0
    reason = _explain(g, ["TI101", "FIC200", "TI300"])
    assert reason == "no window without missing values; most missing: TI101 (100% missing), TI300 (12%)"


def test_explain_rounds_small_and_near_total_ratios_honestly() -> None:
    g = _grid(1000)
    g[::2, 0] = np.nan  # every window reads a gap
    g[:999, 1] = np.nan
    g[3, 2] = np.nan
    reason = _explain(g, ["A", "B", "C"])
    assert reason == "no window without missing values; most missing: B (>99% missing), A (50%), C (<1%)"


def gather_windows(grid, starts, history, horizon, ctrl, tgt):
    """x, u and y of every start, cut as the snapshot writer cuts them (window_block)."""
    return (window_block(grid, starts, -history, 0), window_block(grid[:, ctrl], starts, 0, horizon),
            window_block(grid[:, tgt], starts, 0, horizon))


def test_gather_windows_values_and_shapes() -> None:
    g = _grid(8)
    starts = window_starts(g, 3, 2, 1, CTRL, TGT)
    x, u, y = gather_windows(g, starts, 3, 2, CTRL, TGT)
    assert x.shape == (4, 3, 3) and u.shape == (4, 2, 1) and y.shape == (4, 2, 1)
    assert x.flags.c_contiguous and u.flags.c_contiguous and y.flags.c_contiguous
    assert np.array_equal(x[0], g[0:3])
    assert np.array_equal(u[1, :, 0], g[4:6, 1])
    assert np.array_equal(y[3, :, 0], g[6:8, 2])
    x[0, 0, 0] = -1.0
    assert g[0, 0] == 0.0  # new arrays, never views of the grid


def test_no_controls_gives_u_with_zero_columns() -> None:
    g = _grid(8, nodes=2)
    starts = window_starts(g, 3, 2, 1, [], [1])
    _, u, y = gather_windows(g, starts, 3, 2, [], [1])
    assert u.shape == (starts.size, 2, 0)
    assert y.shape == (starts.size, 2, 1)


def test_gather_keeps_the_grid_dtype_and_handles_no_windows() -> None:
    g = _grid(8).astype(np.float32)
    x, u, y = gather_windows(g, window_starts(g, 3, 2, 1, CTRL, TGT), 3, 2, CTRL, TGT)
    assert x.dtype == u.dtype == y.dtype == np.float32
    x, u, y = gather_windows(_grid(2), np.empty(0, np.int64), 3, 2, CTRL, TGT)
    assert x.shape == (0, 3, 3) and u.shape == (0, 2, 1) and y.shape == (0, 2, 1)


def test_random_grids_match_the_reference() -> None:
    rng = np.random.default_rng(21)
    for trial in range(40):
        T, nodes = int(rng.integers(0, 80)), int(rng.integers(1, 5))
        g = rng.normal(size=(T, nodes))
        g[rng.random((T, nodes)) < rng.choice([0.0, 0.01, 0.05, 0.2])] = np.nan
        H, F, stride = int(rng.integers(1, 8)), int(rng.integers(1, 6)), int(rng.integers(1, 4))
        cols = list(range(nodes))
        ctrl = sorted(rng.choice(cols, size=int(rng.integers(0, nodes + 1)), replace=False).tolist())
        tgt = sorted(rng.choice(cols, size=int(rng.integers(1, nodes + 1)), replace=False).tolist())
        starts = window_starts(g, H, F, stride, ctrl, tgt)
        ref_starts, xs, us, ys = windows_reference(g, H, F, stride, ctrl, tgt)
        assert starts.tolist() == ref_starts, trial
        x, u, y = gather_windows(g, starts, H, F, ctrl, tgt)
        assert (
            x.shape == (len(xs), H, nodes)
            and u.shape == (len(us), F, len(ctrl))
            and y.shape == (len(ys), F, len(tgt))
        )
        for i in range(len(xs)):
            assert np.array_equal(x[i], xs[i]) and np.array_equal(u[i], us[i]) and np.array_equal(y[i], ys[i])


def test_window_timestamps() -> None:
    # As the snapshot writer cuts them: the grid's timestamps as a column, through window_block.
    grid_ts = np.arange(10, dtype=np.int64) * 1000 + 5000
    ts = window_block(grid_ts[:, None], np.array([3, 5]), -3, 2)[:, :, 0]
    assert ts.tolist() == [[5000, 6000, 7000, 8000, 9000], [7000, 8000, 9000, 10000, 11000]]
    assert window_block(grid_ts[:, None], np.empty(0, np.int64), -3, 2)[:, :, 0].shape == (0, 5)


@pytest.mark.parametrize(
    ("H", "F", "stride", "ctrl", "tgt", "message"),
    [
        (0, 2, 1, CTRL, TGT, "history"),
        (3, 0, 1, CTRL, TGT, "horizon"),
        (3, 2, 0, CTRL, TGT, "stride"),
        (3.0, 2, 1, CTRL, TGT, "history"),
        (3, 2, 1, [3], TGT, "control_cols"),
        (3, 2, 1, CTRL, [-1], "target_cols"),
    ],
)
def test_window_starts_validates_arguments(H, F, stride, ctrl, tgt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        window_starts(_grid(10), H, F, stride, ctrl, tgt)


def test_windows_outside_the_grid_and_bad_grids_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[t-3, t\+0\) falls outside the 10 grid rows"):
        gather_windows(_grid(10), np.array([2]), 3, 2, CTRL, TGT)
    with pytest.raises(ValueError, match=r"\[t\+0, t\+2\) falls outside the 10 grid rows"):
        gather_windows(_grid(10), np.array([9]), 3, 2, CTRL, TGT)
    with pytest.raises(ValueError, match="2-D"):
        StartFinder(10, 3, 3, 2, 1, CTRL, TGT).feed(np.zeros(10))
    with pytest.raises(ValueError, match="node ids"):
        _explain(_grid(10), ["a"])


def test_window_block_cuts_rows_around_each_start() -> None:
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    block = window_block(values, np.array([2, 5]), -2, 1)
    assert block.shape == (2, 3, 2) and block.dtype == np.float32 and block.flags.c_contiguous
    assert np.array_equal(block[0], values[0:3]) and np.array_equal(block[1], values[3:6])
    assert window_block(values, np.empty(0, np.int64), 0, 4).shape == (0, 4, 2)
    grid_ts = np.arange(10, dtype=np.int64) * 1000
    starts = np.array([3, 6])
    assert np.array_equal(
        window_block(grid_ts[:, None], starts, -3, 2)[:, :, 0], window_timestamps_reference(grid_ts, starts, 3, 2)
    )


def test_window_block_validates() -> None:
    values = np.zeros((10, 2))
    with pytest.raises(ValueError, match="lo < hi"):
        window_block(values, np.array([3]), 0, 0)
    with pytest.raises(ValueError, match="outside"):
        window_block(values, np.array([1]), -2, 0)
    with pytest.raises(ValueError, match="outside"):
        window_block(values, np.array([9]), 0, 2)
    with pytest.raises(ValueError, match="2-D"):
        window_block(np.zeros(10), np.array([3]), 0, 1)


@pytest.mark.parametrize("stride", [1, 2, 5])
def test_start_finder_equals_window_starts_for_any_blocks(stride) -> None:
    rng = np.random.default_rng(1)
    g = rng.normal(size=(200, 3))
    g[rng.choice(200, 15), rng.choice(3, 15)] = np.nan
    whole = window_starts(g, 7, 4, stride, CTRL, TGT)
    assert 0 < whole.size < len(range(7, 197, stride))
    for block in (1, 2, 3, 10, 11, 64, 200):
        finder = StartFinder(200, 3, 7, 4, stride, CTRL, TGT)
        parts = [finder.feed(g[i : i + block]) for i in range(0, 200, block)] + [finder.finish()]
        assert np.concatenate(parts).tolist() == whole.tolist()
    with pytest.raises(ValueError, match="fed"):
        StartFinder(200, 3, 7, 4, stride, CTRL, TGT).finish()
