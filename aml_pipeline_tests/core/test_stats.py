from __future__ import annotations

import json

import numpy as np
import pytest

from aml_pipeline.core.stats import (
    MIN_LAG_PAIRS,
    LagCorrelation,
    NodeSummary,
    lag_cross_correlation,
    lag_pair_batches,
    summarize,
)


def test_summarize_ignores_missing_values() -> None:
    s = summarize(np.array([1.0, np.nan, 3.0, np.nan]))
    assert s == {"count": 2, "mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "missingRatio": 0.5}
    json.dumps(s, allow_nan=False)


def test_summarize_all_missing_or_empty_is_json_safe() -> None:
    for values in (np.full(4, np.nan), np.empty(0), np.array([np.inf, -np.inf])):
        s = summarize(values)
        assert s["count"] == 0 and s["missingRatio"] == 1.0
        assert s["mean"] is None and s["std"] is None and s["min"] is None and s["max"] is None
        json.dumps(s, allow_nan=False)


def test_summarize_returns_plain_python_types() -> None:
    s = summarize(np.arange(5, dtype=np.float32))
    assert type(s["count"]) is int
    assert all(type(s[k]) is float for k in ("mean", "std", "min", "max", "missingRatio"))
    assert s["std"] == pytest.approx(np.sqrt(2.0))


def _delayed(
    rng: np.random.Generator, n: int, lag: int, gain: float, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    # A setpoint-like control (random steps) and a target that follows it `lag` steps later.
    control = np.cumsum(rng.normal(size=n + lag) * (rng.random(n + lag) < 0.3))
    target = 50.0 + gain * control[:n] + noise * rng.normal(size=n)
    return control[lag:], target


def test_target_delayed_by_seven_steps_is_found() -> None:
    rng = np.random.default_rng(0)
    control, target = _delayed(rng, 3000, 7, 2.0, 0.05)
    r = lag_cross_correlation(control, target, 20)
    assert r["lagSteps"] == 7
    assert r["corr"] > 0.9
    assert r["pairs"] == 3000 - 1 - 7


def test_negative_gain_is_found_with_a_negative_correlation() -> None:
    rng = np.random.default_rng(1)
    control, target = _delayed(rng, 2000, 3, -0.5, 0.02)
    r = lag_cross_correlation(control, target, 10)
    assert r["lagSteps"] == 3 and r["corr"] < -0.9


def test_missing_values_are_ignored_pairwise() -> None:
    rng = np.random.default_rng(2)
    control, target = _delayed(rng, 3000, 7, 1.0, 0.05)
    control[rng.random(control.size) < 0.05] = np.nan
    target[500:700] = np.nan
    r = lag_cross_correlation(control, target, 15)
    assert r["lagSteps"] == 7
    assert r["pairs"] < 3000 - 1 - 7 - 200


def test_lag_zero_and_max_lag_beyond_the_series() -> None:
    rng = np.random.default_rng(3)
    control, target = _delayed(rng, 60, 0, 1.0, 0.01)
    assert lag_cross_correlation(control, target, 0)["lagSteps"] == 0
    assert lag_cross_correlation(control, target, 10_000)["lagSteps"] == 0


def test_too_few_pairs_or_no_variance_gives_none() -> None:
    short = np.arange(MIN_LAG_PAIRS, dtype=float)  # MIN_LAG_PAIRS - 1 differences
    assert lag_cross_correlation(short, short, 3) == {
        "lagSteps": None,
        "corr": None,
        "pairs": MIN_LAG_PAIRS - 1,
    }
    ramp = np.arange(100, dtype=float)  # constant first differences: zero variance
    r = lag_cross_correlation(ramp, np.sin(ramp), 5)
    assert r["lagSteps"] is None and r["corr"] is None and r["pairs"] == 99
    assert lag_cross_correlation(np.full(50, np.nan), np.arange(50.0), 5)["pairs"] == 0
    assert lag_cross_correlation(np.empty(0), np.empty(0), 5) == {"lagSteps": None, "corr": None, "pairs": 0}


def test_lag_validates_arguments() -> None:
    with pytest.raises(ValueError, match="equal length"):
        lag_cross_correlation(np.zeros(10), np.zeros(9), 3)
    with pytest.raises(ValueError, match="max_lag"):
        lag_cross_correlation(np.zeros(10), np.zeros(10), -1)
    with pytest.raises(ValueError, match="max_lag"):
        lag_cross_correlation(np.zeros(10), np.zeros(10), 1.5)


def test_node_summary_streams_runs_like_one_concatenated_summary() -> None:
    rng = np.random.default_rng(4)
    runs = [300.0 + 0.01 * rng.normal(size=n) for n in (500, 1, 0, 2000)]
    runs[0][::7] = np.nan
    acc = NodeSummary()
    for r in runs:
        acc.add(r)
    got, want = acc.result(), summarize(np.concatenate(runs))
    assert got["count"] == want["count"] and got["min"] == want["min"] and got["max"] == want["max"]
    assert got["missingRatio"] == pytest.approx(want["missingRatio"], rel=1e-15)
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-14)
    assert got["std"] == pytest.approx(want["std"], rel=1e-9)
    assert NodeSummary().result()["missingRatio"] == 1.0


def test_lag_correlation_streams_runs_without_pairing_across_run_boundaries() -> None:
    rng = np.random.default_rng(5)
    runs = [_delayed(rng, n, 4, 1.5, 0.3) for n in (400, 700, 50)]
    acc = LagCorrelation(8)
    for control, target in runs:
        acc.add(control, target)
    r = acc.result(beat_ms=2000)
    assert r["lagSteps"] == 4 and r["lagMs"] == 8000
    assert r["pairs"] == sum(n - 1 - 4 for n in (400, 700, 50))
    # Same as the Pearson correlation over the explicitly collected within-run pairs.
    a = np.concatenate([np.diff(c)[: c.size - 1 - 4] for c, _ in runs])
    b = np.concatenate([np.diff(t)[4:] for _, t in runs])
    assert r["corr"] == pytest.approx(float(np.corrcoef(a, b)[0, 1]), rel=1e-12)
    assert acc.result()["lagMs"] is None
    empty = LagCorrelation(3).result(1000)
    assert empty == {"lagSteps": None, "lagMs": None, "corr": None, "pairs": 0}
    with pytest.raises(ValueError, match="max_lag"):
        LagCorrelation(-2)


@pytest.mark.parametrize("first", [0, 5])
def test_lag_pair_batches_equal_the_pairwise_correlations_to_the_bit(first) -> None:
    # Columns with the same gaps share their mask's cross-correlations; the batches must still be
    # exactly what each pair's own LagCorrelation.add computes.
    rng = np.random.default_rng(3)
    n = 500
    columns = {name: np.cumsum(rng.normal(size=n)) for name in ("c1", "c2", "c3", "t1", "t2", "t3")}
    for name in ("c2", "t2"):  # the same gap in a control and a target
        columns[name][100:120] = np.nan
    columns["t3"][rng.choice(n, 40, replace=False)] = np.nan  # a mask of its own
    pairs = {(c, t): 12 for c in ("c1", "c2", "c3") for t in ("t1", "t2", "t3")}
    pairs[("c1", "t1")] = 4  # another max_lag: another slice of the same transforms
    for (c, t), batch in lag_pair_batches(pairs, columns, first):
        alone = LagCorrelation(pairs[(c, t)]).add(columns[c], columns[t], first)
        merged = LagCorrelation(pairs[(c, t)])
        merged.merge(batch)
        for field in ("n", "mean_a", "mean_b", "m2_a", "m2_b", "c_ab"):
            assert getattr(merged, field).tobytes() == getattr(alone, field).tobytes(), (c, t, field)
