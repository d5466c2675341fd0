from __future__ import annotations

import json

import numpy as np
import pytest

from aml_pipeline.core.normalize import (
    MomentAccumulator,
    NormStats,
    accumulate_window_stats,
    apply_norm,
    batch_moments,
    window_row_weights,
)
from aml_pipeline_tests.core.whole_series import window_starts
from aml_pipeline_tests.reference import window_mean_std_reference, windows_reference

# --- MomentAccumulator --------------------------------------------------------------------------


def test_batches_and_merges_match_numpy_mean_and_population_std() -> None:
    rng = np.random.default_rng(1)
    data = rng.normal([5.0, -3.0, 100.0], [1.0, 0.1, 20.0], size=(10_000, 3))
    acc = MomentAccumulator(3)
    for chunk in np.array_split(data[:6000], 7):
        acc.add(chunk)
    other = MomentAccumulator(3)
    other.add(data[6000:])
    acc.merge(other)
    r = acc.result()
    assert r.count == 10_000
    np.testing.assert_allclose(r.mean, data.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(r.std, data.std(axis=0), rtol=1e-12)
    assert not r.zero_std.any()


@pytest.mark.parametrize("spread", [1e-2, 1e-4])
def test_plant_signal_keeps_precision(spread: float) -> None:
    # 300 K +- a little: E[x^2] - E[x]^2 cancels catastrophically here, a two-pass does not.
    rng = np.random.default_rng(2)
    data = 300.0 + spread * rng.standard_normal((1_000_000, 1))
    acc = MomentAccumulator(1)
    for chunk in np.array_split(data, 13):
        acc.add(chunk)
    r = acc.result()
    exact_std = float(np.std(data[:, 0] - 300.0))  # x - 300 is exact here (Sterbenz), so this is the truth
    assert abs(r.std[0] - exact_std) / exact_std < 1e-10
    assert abs(r.mean[0] - 300.0 - float(np.mean(data[:, 0] - 300.0))) < 1e-12
    if spread == 1e-4:
        naive = np.sqrt(np.mean(data[:, 0] ** 2) - np.mean(data[:, 0]) ** 2)
        assert abs(naive - exact_std) / exact_std > 1e-5  # the failure mode this guards against


def test_weights_equal_repeating_rows() -> None:
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(50, 2))
    w = rng.integers(0, 5, size=50)
    acc = MomentAccumulator(2)
    acc.add(rows, w)
    repeated = np.repeat(rows, w, axis=0)
    r = acc.result()
    assert r.count == w.sum()
    np.testing.assert_allclose(r.mean, repeated.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(r.std, repeated.std(axis=0), rtol=1e-12)


def test_constant_column_is_flagged_and_gets_std_one() -> None:
    acc = MomentAccumulator(2)
    rng = np.random.default_rng(4)
    for _ in range(5):
        acc.add(np.column_stack([np.full(37, 0.1 + 0.2), rng.normal(size=37)]), rng.integers(1, 9, 37))
    r = acc.result()
    assert r.zero_std.tolist() == [True, False]
    assert r.std[0] == 1.0 and r.mean[0] == 0.1 + 0.2
    assert r.std[1] > 0


def test_rows_of_weight_zero_are_ignored_even_if_nan() -> None:
    acc = MomentAccumulator(1)
    acc.add(np.array([[1.0], [np.nan], [3.0]]), np.array([1, 0, 1]))
    assert acc.result().mean.tolist() == [2.0]
    with pytest.raises(ValueError, match="non-finite"):
        acc.add(np.array([[np.nan]]), np.array([1]))


def test_no_data_raises() -> None:
    acc = MomentAccumulator(2)
    acc.add(np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="no training windows"):
        acc.result()
    with pytest.raises(ValueError, match="no training windows"):
        MomentAccumulator(0).result()


def test_zero_columns_accumulate_a_count() -> None:
    acc = MomentAccumulator(0)
    acc.add(np.empty((4, 0)), np.array([1, 2, 0, 1]))
    r = acc.result()
    assert r.count == 4 and r.mean.shape == (0,) and r.std.shape == (0,)
    assert r.to_json() == {"mean": [], "std": []}


def test_accumulator_validates_shapes() -> None:
    acc = MomentAccumulator(2)
    with pytest.raises(ValueError, match=r"\[rows, 2\]"):
        acc.add(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="weights"):
        acc.add(np.zeros((3, 2)), np.ones(2))
    with pytest.raises(ValueError, match="weights"):
        acc.add(np.zeros((3, 2)), np.array([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="columns"):
        acc.merge(MomentAccumulator(3))


def test_norm_stats_to_json_is_plain_floats() -> None:
    stats = NormStats(
        mean=np.array([1.5, 2.0]), std=np.array([0.5, 1.0]), zero_std=np.array([False, True]), count=4.0
    )
    out = stats.to_json()
    assert out == {"mean": [1.5, 2.0], "std": [0.5, 1.0]}
    assert all(type(v) is float for v in out["mean"] + out["std"])
    json.dumps(out, allow_nan=False)


# --- row weights and window statistics ------------------------------------------------------


def test_window_row_weights_count_covering_windows() -> None:
    starts = np.array([3, 4, 5, 8])
    T = 11
    for lo, hi in ((-3, 0), (0, 2), (-1, 3)):
        got = window_row_weights(starts, T, lo, hi)
        want = [sum(1 for t in starts if t + lo <= r < t + hi) for r in range(T)]
        assert got.tolist() == want
    assert window_row_weights(np.empty(0, np.int64), 5, -2, 0).tolist() == [0] * 5


def test_window_row_weights_validates() -> None:
    with pytest.raises(ValueError, match="lo < hi"):
        window_row_weights(np.array([3]), 10, 0, 0)
    with pytest.raises(ValueError, match="outside"):
        window_row_weights(np.array([1]), 10, -3, 0)
    with pytest.raises(ValueError, match="outside"):
        window_row_weights(np.array([9]), 10, 0, 2)


def _grid_with_gaps(rng: np.random.Generator, T: int) -> np.ndarray:
    g = np.column_stack(
        [
            300.0 + 0.05 * rng.standard_normal(T),  # feature
            rng.uniform(0, 50, T),  # control
            20.0 + rng.standard_normal(T),  # target
            np.round(rng.normal(size=T)),  # feature
        ]
    )
    g[rng.random((T, 4)) < 0.01] = np.nan
    g[100:110, 0] = np.nan
    return g


@pytest.mark.parametrize("stride", [1, 3])
def test_row_weighted_fit_equals_mean_std_over_explicit_windows(stride: int) -> None:
    rng = np.random.default_rng(10 + stride)
    H, F, ctrl, tgt = 12, 5, [1], [2]
    grids = [_grid_with_gaps(rng, T) for T in (400, 250, 30)]
    acc = (MomentAccumulator(4), MomentAccumulator(1), MomentAccumulator(1))
    xs, us, ys = [], [], []
    for g in grids:
        starts = window_starts(g, H, F, stride, ctrl, tgt)
        accumulate_window_stats(*acc, g, starts, H, F, ctrl, tgt)
        _, rx, ru, ry = windows_reference(g, H, F, stride, ctrl, tgt)
        xs += rx
        us += ru
        ys += ry
    assert len(xs) > 100
    for a, windows, n_cols in zip(acc, (xs, us, ys), (4, 1, 1), strict=True):
        r = a.result()
        mean, std = window_mean_std_reference(windows, n_cols)
        assert r.count == len(windows) * windows[0].shape[0]
        np.testing.assert_allclose(r.mean, mean, rtol=1e-12)
        np.testing.assert_allclose(r.std, std, rtol=1e-9)


def fit_window_stats(grid, starts, history, horizon, ctrl, tgt):
    """Fresh x/u/y accumulators holding one run's windows."""
    grid = np.asarray(grid, dtype=np.float64)
    acc = (MomentAccumulator(grid.shape[1]), MomentAccumulator(len(ctrl)), MomentAccumulator(len(tgt)))
    accumulate_window_stats(*acc, grid, starts, history, horizon, ctrl, tgt)
    return acc


def test_fit_window_stats_per_run_then_merge_equals_streaming() -> None:
    rng = np.random.default_rng(30)
    H, F, ctrl, tgt = 6, 3, [1], [2]
    grids = [_grid_with_gaps(rng, 200), _grid_with_gaps(rng, 150)]
    per_run = [fit_window_stats(g, window_starts(g, H, F, 1, ctrl, tgt), H, F, ctrl, tgt) for g in grids]
    merged = per_run[0]
    for a, b in zip(merged, per_run[1], strict=True):
        a.merge(b)
    streamed = (MomentAccumulator(4), MomentAccumulator(1), MomentAccumulator(1))
    for g in grids:
        accumulate_window_stats(*streamed, g, window_starts(g, H, F, 1, ctrl, tgt), H, F, ctrl, tgt)
    for a, b in zip(merged, streamed, strict=True):
        np.testing.assert_allclose(a.result().mean, b.result().mean, rtol=1e-13)
        np.testing.assert_allclose(a.result().std, b.result().std, rtol=1e-11)


def test_fit_with_no_controls_and_no_windows() -> None:
    g = np.arange(40.0).reshape(20, 2)
    _, acc_u, _ = fit_window_stats(g, window_starts(g, 3, 2, 1, [], [1]), 3, 2, [], [1])
    assert acc_u.n_cols == 0 and acc_u.result().mean.shape == (0,)
    acc_x, _, _ = fit_window_stats(g, np.empty(0, np.int64), 3, 2, [], [1])
    with pytest.raises(ValueError, match="no training windows"):
        acc_x.result()


def test_accumulate_rejects_mismatched_accumulators() -> None:
    g = np.zeros((10, 3))
    with pytest.raises(ValueError, match="acc_u"):
        accumulate_window_stats(
            MomentAccumulator(3), MomentAccumulator(2), MomentAccumulator(1), g, np.array([3]), 3, 2, [1], [2]
        )
    with pytest.raises(ValueError, match="out of range"):
        fit_window_stats(g, np.array([3]), 3, 2, [5], [2])


# --- apply_norm ---------------------------------------------------------------------------------


def test_apply_norm_is_float32_of_the_float64_formula() -> None:
    rng = np.random.default_rng(5)
    v = 300.0 + rng.normal(size=(7, 4, 3))
    mean, std = np.array([300.0, 299.5, 301.0]), np.array([1.0, 0.01, 3.0])
    out = apply_norm(v, mean, std)
    assert out.dtype == np.float32 and out.shape == v.shape
    assert np.array_equal(out, ((v - mean) / std).astype(np.float32))
    # float32 inputs are widened first, not subtracted in float32.
    v32 = v.astype(np.float32)
    assert np.array_equal(
        apply_norm(v32, mean, std), ((v32.astype(np.float64) - mean) / std).astype(np.float32)
    )


def test_apply_norm_handles_zero_columns_and_validates() -> None:
    assert apply_norm(np.empty((2, 3, 0)), np.empty(0), np.empty(0)).shape == (2, 3, 0)
    with pytest.raises(ValueError, match="last axis"):
        apply_norm(np.zeros((2, 3)), np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match="non-zero"):
        apply_norm(np.zeros((2, 2)), np.zeros(2), np.array([1.0, 0.0]))


def test_block_row_weights_add_up_to_the_whole_run() -> None:
    from aml_pipeline.core.normalize import block_row_weights

    starts = np.array([3, 4, 9, 15, 16, 17], np.int64)
    whole = window_row_weights(starts, 20, -3, 2)
    for size in (1, 4, 7, 20):
        parts = [block_row_weights(starts, r0, min(size, 20 - r0), -3, 2) for r0 in range(0, 20, size)]
        assert np.concatenate(parts).tolist() == whole.tolist()


@pytest.mark.parametrize("shape", [(50, 1), (50, 3), (1, 4)])
def test_add_leaves_the_values_as_they_were(shape) -> None:
    # The accumulator works in place on its own copy of the values; a single column (whose
    # transpose is already contiguous) must not be overwritten either.
    rng = np.random.default_rng(1)
    values = rng.normal(size=shape)
    before = values.copy()
    for weights in (None, rng.integers(0, 3, size=shape[0]).astype(float)):
        if weights is not None and not (weights > 0).any():
            weights[0] = 1.0
        acc = MomentAccumulator(shape[1])
        acc.add(values, weights)
        assert np.array_equal(values, before)
        w = np.ones(shape[0]) if weights is None else weights
        mean = (values * w[:, None]).sum(axis=0) / w.sum()
        np.testing.assert_allclose(acc.mean, mean, rtol=1e-12, atol=1e-12)


def test_batches_computed_apart_and_merged_in_order_equal_add():
    rng = np.random.default_rng(5)
    blocks = [(300.0 + rng.normal(0, 10.0 ** -k, (50 + 7 * k, 3)), rng.integers(0, 4, 50 + 7 * k)) for k in range(6)]
    added = MomentAccumulator(3)
    for values, weights in blocks:
        added.add(values, weights)
    batches = [batch_moments(v, w, 3) for v, w in blocks]
    merged = MomentAccumulator(3)
    for b in batches:
        merged.add_batch(b)
    assert (merged.count, merged.mean.tobytes(), merged.m2.tobytes()) == (added.count, added.mean.tobytes(), added.m2.tobytes())
    backwards = MomentAccumulator(3)
    for b in batches[::-1]:
        backwards.add_batch(b)
    assert (backwards.mean.tobytes(), backwards.m2.tobytes()) != (added.mean.tobytes(), added.m2.tobytes())
    assert batch_moments(np.zeros((2, 3)), np.zeros(2), 3) is None
