"""Time-weighted beat means: against an exact (rational) per-row reference, on small cases stated
by hand, and on the aliasing they exist to prevent."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.aggregate import mean_hold, mean_linear
from aml_pipeline_tests.reference import mean_reference


def _random_series(rng: np.random.Generator, trial: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(0, 40))
    steps = rng.choice([100, 250, 300, 700, 1000, 1000, 1500, 3000, 7000], size=n)
    ts = (1000 * int(rng.integers(0, 5)) + np.cumsum(steps)).astype(np.int64)
    if trial % 3 == 0:  # points on grid times and interval starts
        ts = np.unique((ts // 500) * 500)
    return ts, rng.normal(size=ts.size) * 10


@pytest.mark.parametrize("causal", [False, True], ids=["centred", "causal"])
@pytest.mark.parametrize("interp", ["linear", "hold"])
def test_means_equal_the_exact_reference(interp: str, causal: bool) -> None:
    rng = np.random.default_rng(1)
    compared = 0
    for trial in range(200):
        ts, value = _random_series(rng, trial)
        beat = int(rng.choice([500, 1000, 2000]))
        max_gap = int(rng.choice([0, 1000, 2500, 5000]))
        grid = np.arange(0, 60_000, beat, dtype=np.int64)
        causal_beat = beat if causal else None
        if interp == "linear":
            got = mean_linear(ts, value, grid, max_gap, beat, causal_beat)
        else:
            got = mean_hold(ts, value, grid, max_gap, beat)
        want = mean_reference(ts, value, grid, max_gap, beat, interp, causal_beat)
        assert np.array_equal(np.isnan(got), np.isnan(want)), (trial, np.flatnonzero(np.isnan(got) != np.isnan(want)))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-13, atol=1e-12)
        compared += int(ok.sum())
    assert compared > 1000


TS = np.array([0, 500, 1000, 2000, 2600, 9000], np.int64)
VALUE = np.array([0.0, 1.0, 0.0, 4.0, 4.0, 1.0])


def test_linear_mean_by_hand() -> None:
    grid = np.array([1000, 2000, 3000, 9000], np.int64)
    got = mean_linear(TS, VALUE, grid, 5000, 1000)
    # (0, 1000]: triangles up to 1 and back: 0.5. (1000, 2000]: 0 -> 4 linearly: 2.
    # (2000, 3000]: 4 until 2600, then towards 1 at 9000 (gap 6.4 s > 5 s): missing. So is 9000's.
    assert got[:2].tolist() == [0.5, 2.0] and np.isnan(got[2:]).all()
    wide = mean_linear(TS, VALUE, grid, 10_000, 1000)
    assert wide[2] == pytest.approx((4.0 * 600 + (4.0 + (4.0 - 3.0 * 400 / 6400)) / 2 * 400) / 1000)


def test_hold_mean_by_hand() -> None:
    grid = np.array([500, 1000, 2000, 3000, 8000], np.int64)
    got = mean_hold(TS, VALUE, grid, 5000, 1000)
    # (-500, 500]: no point at or before -500: missing. (0, 1000]: 0 then 1: 0.5.
    # (1000, 2000]: 0 all along (2000's 4 starts at the end). (2000, 3000]: 4.
    # (7000, 8000]: 2600's value is more than 5 s old by then: missing.
    assert np.isnan(got[0]) and got[1:4].tolist() == [0.5, 0.0, 4.0] and np.isnan(got[4])


def test_causal_linear_mean_holds_where_the_next_point_is_a_beat_away() -> None:
    ts = np.array([0, 1000, 1500, 3500], np.int64)
    value = np.array([0.0, 2.0, 2.0, 6.0])
    grid = np.array([2000, 3000], np.int64)
    causal = mean_linear(ts, value, grid, 5000, 1000, 1000)
    centred = mean_linear(ts, value, grid, 5000, 1000)
    # (1000, 2000]: 2 held to 1500, then towards 6 at 3500: 2 + 4 * 500/2000 at 2000. Causal: the
    # 3500 point is 1.5 s after 2000, so 2 is held to 2000. (2000, 3000]: 3500 is within a beat.
    assert centred[0] == pytest.approx((2.0 * 500 + (2.0 + 3.0) / 2 * 500) / 1000)
    assert causal[0] == 2.0
    assert causal[1] == centred[1] == pytest.approx((3.0 + 5.0) / 2)


def test_a_constant_is_its_own_mean() -> None:
    ts = np.arange(0, 60_000, 97, dtype=np.int64)
    value = np.full(ts.size, 41.3)
    grid = np.arange(1000, 59_000, 1000, dtype=np.int64)
    for got in (mean_linear(ts, value, grid, 5000, 1000), mean_hold(ts, value, grid, 5000, 1000)):
        np.testing.assert_allclose(got, 41.3, rtol=1e-14)


def test_the_beat_mean_removes_noise_and_pulsation_that_point_values_alias() -> None:
    """A constant process at 10 Hz with unit noise, or with a 4.3 Hz pulsation of amplitude 2, on a
    1 s beat: point values keep the noise and turn the pulsation into a slow oscillation; the beat's
    mean does neither."""
    from aml_pipeline.core.grid import align_linear

    rng = np.random.default_rng(3)
    ts = np.arange(0, 600_000, 100, dtype=np.int64)
    grid = np.arange(1000, 599_000, 1000, dtype=np.int64)
    noisy = 50.0 + rng.normal(0.0, 1.0, ts.size)
    assert np.std(align_linear(ts, noisy, grid, 5000)) > 0.9
    assert np.std(mean_linear(ts, noisy, grid, 5000, 1000)) < 0.4
    pulsing = 50.0 + 2.0 * np.sin(2 * np.pi * 4.3 * ts / 1000.0)
    points = align_linear(ts, pulsing, grid, 5000)
    means = mean_linear(ts, pulsing, grid, 5000, 1000)
    assert np.ptp(points) > 3.0 and np.ptp(means) < 0.5
