from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.aggregate import mean_hold, mean_linear
from aml_pipeline.core.grid import GridAligner, align_hold, align_linear, grid_span, missing_ratio
from aml_pipeline_tests.core.whole_series import align, grid_times, node_params
from aml_pipeline_tests.reference import align_hold_reference, align_linear_reference

# --- grid_times ---------------------------------------------------------------------------------


def test_grid_starts_at_the_first_beat_multiple_and_includes_end() -> None:
    g = grid_times(1_700_000_000_250, 1_700_000_003_000, 1000)
    assert g.dtype == np.int64
    assert g.tolist() == [1_700_000_001_000, 1_700_000_002_000, 1_700_000_003_000]


def test_grid_aligned_start_is_included() -> None:
    assert grid_times(2000, 4500, 1000).tolist() == [2000, 3000, 4000]
    assert grid_times(2000, 2000, 1000).tolist() == [2000]


def test_grid_negative_start_uses_integer_ceil() -> None:
    assert grid_times(-2500, 0, 1000).tolist() == [-2000, -1000, 0]
    assert grid_times(-3000, -1000, 1000).tolist() == [-3000, -2000, -1000]


def test_grid_is_empty_when_no_beat_fits() -> None:
    assert grid_times(1001, 1999, 1000).size == 0
    assert grid_times(5000, 1000, 1000).size == 0
    assert grid_times(5000, 1000, 1000).dtype == np.int64


def test_grid_uses_exact_integer_arithmetic_for_large_epochs() -> None:
    start = 2**53 + 1  # a float round-trip would lose the last digit
    g = grid_times(start, start + 10, 3)
    assert g.tolist() == [t for t in range(start, start + 11) if t % 3 == 0]


@pytest.mark.parametrize("args", [(0, 10, 0), (0, 10, -5), (0.5, 10, 1), (0, 10, 1.0), (0, 10, True)])
def test_grid_rejects_bad_arguments(args: tuple) -> None:
    with pytest.raises(ValueError):
        grid_times(*args)


# --- linear -------------------------------------------------------------------------------------

TS = np.array([1000, 3000, 8000, 9000], dtype=np.int64)
VAL = np.array([1.0, 3.0, 8.0, -1.0])


def test_linear_exact_hits_take_the_point_value() -> None:
    out = align_linear(TS, VAL, TS.copy(), max_interp_ms=0)
    assert out.tolist() == VAL.tolist()


def test_linear_interpolates_within_max_gap() -> None:
    out = align_linear(TS, VAL, np.array([2000, 8500]), max_interp_ms=2000)
    assert out.tolist() == [2.0, 3.5]


def test_linear_gap_exactly_max_is_bridged_one_ms_more_is_not() -> None:
    # The gap 3000 -> 8000 is 5000 ms.
    g = np.array([4000, 5000, 7999])
    bridged = align_linear(TS, VAL, g, max_interp_ms=5000)
    assert bridged.tolist() == [4.0, 5.0, 3.0 + 5.0 * (4999 / 5000)]
    assert np.isnan(align_linear(TS, VAL, g, max_interp_ms=4999)).all()
    # Exact hits at both ends of the long gap still count.
    assert align_linear(TS, VAL, np.array([3000, 8000]), max_interp_ms=0).tolist() == [3.0, 8.0]


def test_linear_never_extrapolates() -> None:
    out = align_linear(TS, VAL, np.array([0, 999, 9001, 20000]), max_interp_ms=10**9)
    assert np.isnan(out).all()


def test_linear_with_one_or_no_points() -> None:
    one = align_linear(np.array([5000]), np.array([7.0]), np.array([4000, 5000, 6000]), max_interp_ms=10**6)
    assert np.isnan(one[0]) and one[1] == 7.0 and np.isnan(one[2])
    none = align_linear(np.empty(0, np.int64), np.empty(0), np.array([0, 1000]), max_interp_ms=1000)
    assert none.shape == (2,) and np.isnan(none).all()
    assert align_linear(TS, VAL, np.empty(0, np.int64), 1000).shape == (0,)


def test_linear_matches_reference_bitwise_on_random_data() -> None:
    rng = np.random.default_rng(11)
    ts = np.cumsum(rng.integers(1, 4000, 3000)) + 1_700_000_000_000
    value = rng.normal(300.0, 5.0, ts.size)
    grid = grid_times(int(ts[0]) - 5000, int(ts[-1]) + 5000, 1000)
    for max_gap in (0, 999, 1000, 2500, 10_000):
        got = align_linear(ts, value, grid, max_gap)
        want = align_linear_reference(ts, value, grid, max_gap)
        assert np.array_equal(got, want, equal_nan=True)


# --- hold ---------------------------------------------------------------------------------------


def test_hold_carries_the_last_value_up_to_the_age_limit() -> None:
    g = np.array([1000, 2000, 3000, 3001, 8000, 8500])
    out = align_hold(TS, VAL, g, max_interp_ms=2000)
    # 3000 is an exact hit (age 0); 3001 holds 3.0 from 3000 (age 1); 2000 holds 1.0 (age 1000).
    assert out.tolist()[:4] == [1.0, 1.0, 3.0, 3.0]
    assert out[4] == 8.0 and out[5] == 8.0


def test_hold_age_exactly_at_limit_is_kept_one_ms_older_is_not() -> None:
    out = align_hold(TS, VAL, np.array([3000 + 2000, 3000 + 2001]), max_interp_ms=2000)
    assert out[0] == 3.0 and np.isnan(out[1])


def test_hold_is_nan_before_the_first_point() -> None:
    out = align_hold(TS, VAL, np.array([0, 999, 1000]), max_interp_ms=10**9)
    assert np.isnan(out[0]) and np.isnan(out[1]) and out[2] == 1.0


def test_hold_matches_reference_on_random_data() -> None:
    rng = np.random.default_rng(12)
    ts = np.cumsum(rng.integers(1, 5000, 2000))
    value = rng.normal(size=ts.size)
    grid = grid_times(-3000, int(ts[-1]) + 9000, 700)
    for max_age in (0, 699, 700, 3000):
        assert np.array_equal(
            align_hold(ts, value, grid, max_age),
            align_hold_reference(ts, value, grid, max_age),
            equal_nan=True,
        )


# --- dispatch, validation, missing ratio ----------------------------------------------------


def test_align_dispatches_on_interp() -> None:
    def at_2000(interp: str) -> list[float]:  # a grid of one row, at 2000
        aligner = GridAligner(2000, 1000, 1, node_params(interp=interp, max_interp_ms=5000))
        return [v for _, block in [*aligner.feed(TS, VAL), *aligner.finish()] for v in block.tolist()]

    assert at_2000("linear") == [2.0]
    assert at_2000("hold") == [1.0]
    with pytest.raises(ValueError, match="interp"):
        node_params(interp="cubic")


@pytest.mark.parametrize("fn", [align_linear, align_hold])
def test_alignment_rejects_bad_inputs(fn) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        fn(np.array([0, 1000, 1000]), np.zeros(3), np.array([0]), 1000)
    with pytest.raises(ValueError, match="strictly increasing"):
        fn(np.array([0, 2000, 1000]), np.zeros(3), np.array([0]), 1000)
    with pytest.raises(ValueError, match="max_interp_ms"):
        fn(TS, VAL, np.array([0]), -1)
    with pytest.raises(ValueError, match="same length"):
        fn(TS, VAL[:2], np.array([0]), 1000)
    with pytest.raises(ValueError, match="integer"):
        fn(TS.astype(float), VAL, np.array([0]), 1000)


def test_missing_ratio() -> None:
    assert missing_ratio(np.array([1.0, np.nan, 2.0, np.nan])) == 0.5
    assert missing_ratio(np.array([1.0, 2.0])) == 0.0
    assert missing_ratio(np.full(3, np.nan)) == 1.0
    assert missing_ratio(np.empty(0)) == 1.0  # an empty grid observed nothing


# ---- streaming alignment ---------------------------------------------------------------------------



def _stream_align(ts, value, first, beat, rows, cuts, *, interp, max_interp_ms, block_rows=7, **more):
    params = node_params(interp=interp, max_interp_ms=max_interp_ms, **more)
    aligner = GridAligner(first, beat, rows, params, block_rows=block_rows)
    out = []
    bounds = [0, *sorted(cuts), len(ts)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.extend(aligner.feed(ts[a:b], value[a:b]))
    out.extend(aligner.finish())
    rows_seen = [r0 for r0, _ in out]
    assert rows_seen == sorted(rows_seen)
    values = np.concatenate([v for _, v in out]) if out else np.empty(0)
    assert values.size == rows and all(v.size <= block_rows for _, v in out)
    return values


@pytest.mark.parametrize("interp", ["linear", "hold"])
def test_streaming_alignment_equals_whole_for_every_cut(interp) -> None:
    rng = np.random.default_rng(5)
    # Jittered points with gaps shorter and longer than max_interp, a hit on a grid time, a tail.
    ts = np.unique(np.cumsum(rng.choice([300, 900, 1000, 1000, 4000, 12_000], 120)).astype(np.int64)) + 2_500
    value = rng.normal(0, 1, ts.size)
    first, rows = grid_span(0, int(ts[-1]) + 20_000, 1000)
    whole = align(ts, value, grid_times(0, int(ts[-1]) + 20_000, 1000), interp=interp, max_interp_ms=5000)
    assert np.isnan(whole).any() and np.isfinite(whole).any()
    for cut in range(0, ts.size + 1):
        got = _stream_align(ts, value, first, 1000, rows, [cut], interp=interp, max_interp_ms=5000)
        assert got.tobytes() == whole.tobytes()
    got = _stream_align(ts, value, first, 1000, rows, list(range(1, ts.size)), interp=interp, max_interp_ms=5000)
    assert got.tobytes() == whole.tobytes()


def test_streaming_alignment_of_a_series_without_points_is_all_missing() -> None:
    got = _stream_align(np.empty(0, np.int64), np.empty(0), 0, 1000, 10, [], interp="hold", max_interp_ms=5000)
    assert np.isnan(got).all()


def test_hold_fills_after_the_last_point_only_within_max_interp() -> None:
    ts, value = np.array([0, 1000], np.int64), np.array([1.0, 2.0])
    got = _stream_align(ts, value, 0, 1000, 6, [1], interp="hold", max_interp_ms=2000)
    assert got.tolist()[:4] == [1.0, 2.0, 2.0, 2.0] and np.isnan(got[4:]).all()


# ---- causal alignment and beat means, streamed ---------------------------------------------------


def _whole_kernel(ts, value, grid, *, interp, aggregate, causal, max_interp_ms=5000, beat=1000):
    causal_beat = beat if causal else None
    if aggregate == "mean":
        if interp == "linear":
            return mean_linear(ts, value, grid, max_interp_ms, beat, causal_beat)
        return mean_hold(ts, value, grid, max_interp_ms, beat)
    if interp == "linear":
        return align_linear(ts, value, grid, max_interp_ms, causal_beat_ms=causal_beat)
    return align_hold(ts, value, grid, max_interp_ms)


MODES = [(i, a, c) for i in ("linear", "hold") for a in ("point", "mean") for c in (False, True)]


@pytest.mark.parametrize(("interp", "aggregate", "causal"), MODES, ids=[f"{i}-{a}-{'causal' if c else 'centred'}" for i, a, c in MODES])
def test_streaming_means_and_causal_alignment_equal_whole_for_every_cut(interp, aggregate, causal) -> None:
    rng = np.random.default_rng(6)
    # Faster than the beat in places (means over several points), jittered, gaps on both sides of
    # max_interp, points on grid times and on interval starts.
    ts = np.unique(np.cumsum(rng.choice([100, 250, 300, 900, 1000, 1000, 4000, 12_000], 160)).astype(np.int64)) + 2_000
    value = rng.normal(0, 1, ts.size)
    first, rows = grid_span(0, int(ts[-1]) + 20_000, 1000)
    whole = _whole_kernel(ts, value, grid_times(0, int(ts[-1]) + 20_000, 1000), interp=interp, aggregate=aggregate, causal=causal)
    assert np.isnan(whole).any() and np.isfinite(whole).any()
    kw = dict(interp=interp, max_interp_ms=5000, aggregate=aggregate, causal=causal)
    for cut in range(0, ts.size + 1):
        got = _stream_align(ts, value, first, 1000, rows, [cut], **kw)
        assert got.tobytes() == whole.tobytes(), cut
    for block_rows in (1, 3, 1 << 16):
        got = _stream_align(ts, value, first, 1000, rows, list(range(1, ts.size)), block_rows=block_rows, **kw)
        assert got.tobytes() == whole.tobytes()


def test_causal_linear_interpolates_towards_a_point_within_the_beat_else_holds() -> None:
    ts = np.array([0, 1400, 2300, 9000], np.int64)
    value = np.array([0.0, 14.0, 23.0, 90.0])
    grid = np.array([1000, 2000, 3000, 4000, 8000, 8500], np.int64)
    # 1000: the next point (1400) is within a beat: interpolated. 2000: 2300 is: interpolated.
    # 3000: nothing before 4000, so 2300's value is held; 4000 too; 8000: 2300 is older than 5 s.
    # 8500 (not a grid multiple here, but the rule is per time): 9000 is 500 ms on, the gap is 6.7 s.
    got = align_linear(ts, value, grid, 5000, causal_beat_ms=1000)
    assert got[:4].tolist() == [10.0, 20.0, 23.0, 23.0] and np.isnan(got[4:]).all()
    centred = align_linear(ts, value, grid, 5000)
    assert centred[:2].tolist() == [10.0, 20.0] and np.isnan(centred[2:]).all()  # the 2300 -> 9000 gap is not bridged


def test_a_causal_row_depends_only_on_points_before_the_next_grid_time() -> None:
    """Every row of a causal alignment, point or mean, is the same whether or not the points from
    the next grid time on exist: the property a window's history needs."""
    rng = np.random.default_rng(8)
    ts = np.unique(np.cumsum(rng.choice([100, 300, 900, 1000, 1300, 2500, 7000], 200)).astype(np.int64))
    value = rng.normal(0, 1, ts.size)
    grid = grid_times(0, int(ts[-1]), 1000)
    for interp, aggregate in (("linear", "point"), ("linear", "mean"), ("hold", "point"), ("hold", "mean")):
        whole = _whole_kernel(ts, value, grid, interp=interp, aggregate=aggregate, causal=True)
        for r in range(0, grid.size, 3):
            before = ts < grid[r] + 1000
            row = _whole_kernel(ts[before], value[before], grid[r : r + 1], interp=interp, aggregate=aggregate, causal=True)
            assert row.tobytes() == whole[r : r + 1].tobytes(), (interp, aggregate, r)


def test_sample_periods_give_numpy_s_median_in_any_chunking_below_the_cap() -> None:
    from aml_pipeline.core.grid import SamplePeriods

    rng = np.random.default_rng(2)
    for n in (0, 1, 2, 3, 10, 11, 500):
        ts = np.cumsum(rng.choice([90, 100, 100, 110, 400, 5000], size=n)).astype(np.int64)
        want = float(np.median(np.diff(ts))) if n > 1 else None
        for cuts in ([], [1], list(range(1, n)), [n // 3, n // 2]):
            periods = SamplePeriods(1000)
            for a, b in zip([0, *cuts], [*cuts, n]):
                periods.feed(ts[a:b])
            got = periods.median_ms
            assert got == (want if want is not None and want < 1000 else None), (n, cuts)
    slow = SamplePeriods(1000)
    slow.feed(np.arange(0, 100_000, 2000))
    assert slow.median_ms is None and slow.intervals == 49
