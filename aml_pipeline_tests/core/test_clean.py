from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline_tests.core.whole_series import CleanedSeries, clean_series, node_params
from aml_pipeline_tests.reference import hampel_reference


def _clean(ts, value, state=None, **overrides) -> CleanedSeries:
    ts = np.asarray(ts, dtype=np.int64)
    value = np.asarray(value, dtype=np.float64)
    state = np.zeros(ts.size, dtype=np.int32) if state is None else np.asarray(state, dtype=np.int32)
    return clean_series(ts, value, state, node_params(**overrides))


def _assert_counts_add_up(c: CleanedSeries) -> None:
    assert set(c.counts) == {"input", "kept", *CLEAN_CAUSES}
    assert c.counts["input"] == sum(c.counts[k] for k in CLEAN_CAUSES) + c.counts["kept"]
    assert c.counts["kept"] == c.ts.size == c.value.size
    assert c.counts["hampel_outlier"] == c.outlier_ts.size == c.outlier_value.size


def test_clean_input_passes_through() -> None:
    c = _clean([0, 1000, 2000], [1.0, 2.0, 3.0])
    assert c.ts.tolist() == [0, 1000, 2000]
    assert c.value.tolist() == [1.0, 2.0, 3.0]
    assert c.ts.dtype == np.int64 and c.value.dtype == np.float64
    assert c.counts == {"input": 3, **{k: 0 for k in CLEAN_CAUSES}, "kept": 3}


def test_each_cause_counts_a_point_once_in_rule_order() -> None:
    ts = [0, 1, 2, 3, 4, 5, 6, 7]
    value = [np.nan, np.inf, 5.0, 500.0, 500.0, 5.0, -np.inf, 6.0]
    state = [1, 0, 1, 1, 0, 0, 0, 0]
    c = _clean(ts, value, state, valid_range=(0.0, 100.0))
    # index 0: NaN and bad state -> non_finite only; 1, 6: +-inf -> non_finite;
    # 2: bad state; 3: bad state and out of range -> bad_state only; 4: out of range.
    assert c.counts["non_finite"] == 3
    assert c.counts["bad_state"] == 2
    assert c.counts["out_of_range"] == 1
    assert c.ts.tolist() == [5, 7]
    _assert_counts_add_up(c)


def test_range_is_inclusive_and_none_is_unbounded() -> None:
    ts = [0, 1, 2, 3, 4]
    value = [-0.001, 0.0, 50.0, 100.0, 100.001]
    c = _clean(ts, value, valid_range=(0.0, 100.0))
    assert c.value.tolist() == [0.0, 50.0, 100.0]
    assert c.counts["out_of_range"] == 2
    assert _clean(ts, value, valid_range=(0.0, None)).value.tolist() == [0.0, 50.0, 100.0, 100.001]
    assert _clean(ts, value, valid_range=(None, 100.0)).value.tolist() == [-0.001, 0.0, 50.0, 100.0]


def test_good_states_may_list_several_codes() -> None:
    c = _clean([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0], [0, 192, 3, 192], good_states=[0, 192])
    assert c.ts.tolist() == [0, 1, 3]
    assert c.counts["bad_state"] == 1


def test_duplicates_keep_the_highest_seq() -> None:
    # Input order is (ts, seq): within an equal-ts group the last row has the highest seq.
    ts = [0, 1000, 1000, 1000, 2000, 3000, 3000]
    value = [1.0, 10.0, 11.0, 12.0, 2.0, 20.0, 21.0]
    c = _clean(ts, value)
    assert c.ts.tolist() == [0, 1000, 2000, 3000]
    assert c.value.tolist() == [1.0, 12.0, 2.0, 21.0]
    assert c.counts["duplicate_ts"] == 3
    _assert_counts_add_up(c)


def test_duplicates_are_judged_after_the_earlier_rules() -> None:
    # The newest row of the group is bad, so the older good one survives and is no duplicate.
    c = _clean([0, 1000, 1000, 2000], [1.0, 10.0, np.nan, 2.0], [0, 0, 0, 0])
    assert c.value.tolist() == [1.0, 10.0, 2.0]
    assert c.counts["non_finite"] == 1 and c.counts["duplicate_ts"] == 0
    c = _clean([0, 1000, 1000, 2000], [1.0, 10.0, 11.0, 2.0], [0, 0, 5, 0])
    assert c.value.tolist() == [1.0, 10.0, 2.0]
    assert c.counts["bad_state"] == 1 and c.counts["duplicate_ts"] == 0


def test_hampel_runs_over_the_surviving_points_and_reports_outliers() -> None:
    ts = np.arange(12) * 1000
    value = np.array([10.0, 10.1, np.nan, 9.9, 10.0, 80.0, 10.2, 9.8, 10.0, 10.1, 9.9, 10.0])
    c = _clean(ts, value, hampel_k=3, hampel_sigma=3.0)
    assert c.outlier_ts.tolist() == [5000]
    assert c.outlier_value.tolist() == [80.0]
    assert 5000 not in c.ts.tolist()
    assert c.counts["hampel_outlier"] == 1 and c.counts["non_finite"] == 1
    _assert_counts_add_up(c)
    # Same flags as running the reference on the points that reached the Hampel stage.
    survivors = value[np.isfinite(value)]
    assert c.counts["hampel_outlier"] == int(hampel_reference(survivors, 3, 3.0).sum())


def test_hampel_k_zero_keeps_setpoint_steps() -> None:
    value = [5.0, 5.0, 5.0, 30.0, 5.0, 5.0, 5.0]
    assert _clean(range(7), value, hampel_k=0).counts["hampel_outlier"] == 0
    assert _clean(range(7), value, hampel_k=3).counts["hampel_outlier"] == 1
    assert _clean(range(7), value, hampel_k=3, hampel_min_dev=30.0).counts["hampel_outlier"] == 0


def test_all_points_bad_gives_an_empty_series_whose_counts_add_up() -> None:
    c = _clean([0, 1, 2, 3], [np.nan, 1.0, 200.0, 3.0], [0, 9, 0, 9], valid_range=(None, 100.0), hampel_k=5)
    assert c.ts.size == 0 and c.value.size == 0 and c.outlier_ts.size == 0
    assert c.counts == {
        "input": 4,
        "non_finite": 1,
        "bad_state": 2,
        "out_of_range": 1,
        "duplicate_ts": 0,
        "hampel_outlier": 0,
        "kept": 0,
    }


def test_empty_input() -> None:
    c = clean_series(np.empty(0, np.int64), np.empty(0), np.empty(0, np.int32), node_params(hampel_k=5))
    assert c.counts == {"input": 0, **{k: 0 for k in CLEAN_CAUSES}, "kept": 0}
    assert c.ts.dtype == np.int64


def test_random_counts_always_add_up() -> None:
    rng = np.random.default_rng(5)
    n = 5000
    ts = np.sort(rng.integers(0, 2000, n))  # many duplicate timestamps
    value = np.round(rng.normal(50, 10, n))
    value[rng.random(n) < 0.02] = np.nan
    state = (rng.random(n) < 0.05).astype(np.int32)
    c = _clean(ts, value, state, valid_range=(20.0, 80.0), hampel_k=4, hampel_min_dev=1.0)
    _assert_counts_add_up(c)
    assert np.all(np.diff(c.ts) > 0)
    assert np.isfinite(c.value).all() and c.value.min() >= 20.0 and c.value.max() <= 80.0


def test_decreasing_timestamps_are_rejected_naming_the_index() -> None:
    with pytest.raises(ValueError, match="index 2"):
        _clean([0, 1000, 999, 2000], [1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"good_states": []}, "good_states"),
        ({"valid_range": (10.0, 0.0)}, "range_lo"),
        ({"valid_range": (float("nan"), None)}, "range_lo"),
        ({"valid_range": (float("inf"), None)}, "holds no number"),
        ({"valid_range": (None, float("-inf"))}, "holds no number"),
        ({"hampel_k": -1}, "k must be"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _clean([0, 1], [1.0, 2.0], **kwargs)


def test_mismatched_lengths_and_float_timestamps_are_rejected() -> None:
    with pytest.raises(ValueError, match="length"):
        clean_series(np.arange(3), np.zeros(2), np.zeros(3, np.int32), node_params())
    with pytest.raises(ValueError, match="integer"):
        clean_series(np.arange(3.0), np.zeros(3), np.zeros(3, np.int32), node_params())


# ---- streaming: the same result wherever a series is cut ----------------------------------------

from aml_pipeline.core.clean import SeriesCleaner  # noqa: E402


def _stream(ts, value, state, cuts, **kw) -> CleanedSeries:
    """The series cleaned by SeriesCleaner, fed the pieces between ``cuts``."""
    cleaner = SeriesCleaner(node_params(**kw))
    parts = []
    bounds = [0, *sorted(cuts), len(ts)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts.append(cleaner.feed(ts[a:b], value[a:b], state[a:b]))
    parts.append(cleaner.finish())
    return CleanedSeries(
        np.concatenate([p.ts for p in parts]),
        np.concatenate([p.value for p in parts]),
        cleaner.counts,
        np.concatenate([p.outlier_ts for p in parts]),
        np.concatenate([p.outlier_value for p in parts]),
    )


def _assert_same(a: CleanedSeries, b: CleanedSeries) -> None:
    assert a.counts == b.counts
    assert np.array_equal(a.ts, b.ts) and a.value.tobytes() == b.value.tobytes()
    assert np.array_equal(a.outlier_ts, b.outlier_ts) and a.outlier_value.tobytes() == b.outlier_value.tobytes()


def _adversarial_series(seed: int = 3, n: int = 400):
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.choice([0, 1000, 1000, 1000, 7000], size=n)).astype(np.int64)  # duplicates and gaps
    value = 20 + np.cumsum(rng.normal(0, 0.1, n))
    value[rng.choice(n, 12, replace=False)] += rng.choice([-25.0, 25.0], 12)  # spikes for Hampel
    value[rng.choice(n, 6, replace=False)] = np.nan
    value[rng.choice(n, 4, replace=False)] = 1e6  # out of range
    state = np.where(rng.random(n) < 0.05, 3, 0).astype(np.int32)
    return ts, value, state


CLEAN_KW = dict(good_states=[0], valid_range=(-100.0, 100.0), hampel_k=5, hampel_sigma=3.0, hampel_min_dev=0.0)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_streaming_equals_whole_for_every_single_cut(k) -> None:
    ts, value, state = _adversarial_series()
    kw = {**CLEAN_KW, "hampel_k": k}
    whole = clean_series(ts, value, state, node_params(**kw))
    assert whole.counts["duplicate_ts"] and whole.counts["bad_state"] and whole.counts["out_of_range"]
    if k:
        assert whole.counts["hampel_outlier"]
    for cut in range(0, len(ts) + 1):
        _assert_same(_stream(ts, value, state, [cut], **kw), whole)


def test_streaming_equals_whole_in_chunks_of_one_point_and_random_chunks() -> None:
    ts, value, state = _adversarial_series(seed=9, n=300)
    whole = clean_series(ts, value, state, node_params(**CLEAN_KW))
    _assert_same(_stream(ts, value, state, list(range(1, len(ts))), **CLEAN_KW), whole)
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = sorted(set(rng.integers(0, len(ts), rng.integers(1, 30)).tolist()))
        _assert_same(_stream(ts, value, state, cuts, **CLEAN_KW), whole)


def test_cut_inside_a_duplicate_group_keeps_the_newest() -> None:
    ts = np.array([0, 1000, 1000, 1000, 2000], np.int64)
    value = np.array([1.0, 10.0, 11.0, 12.0, 2.0])
    state = np.zeros(5, np.int32)
    for cut in (1, 2, 3, 4):
        c = _stream(ts, value, state, [cut], **{**CLEAN_KW, "hampel_k": 0})
        assert c.value.tolist() == [1.0, 12.0, 2.0] and c.counts["duplicate_ts"] == 2


def test_cut_at_an_outlier_and_at_a_bad_state() -> None:
    ts = np.arange(0, 30_000, 1000, dtype=np.int64)
    value = np.full(30, 5.0) + np.linspace(0, 0.1, 30)
    value[14] = 50.0  # spike
    state = np.zeros(30, np.int32)
    state[15] = 7  # bad state right after it
    whole = clean_series(ts, value, state, node_params(**{**CLEAN_KW, "hampel_k": 3}))
    assert whole.outlier_ts.tolist() == [14_000] and whole.counts["bad_state"] == 1
    for cut in (13, 14, 15, 16):
        _assert_same(_stream(ts, value, state, [cut], **{**CLEAN_KW, "hampel_k": 3}), whole)


def test_chunks_out_of_order_are_refused() -> None:
    cleaner = SeriesCleaner(node_params(**CLEAN_KW))
    cleaner.feed(np.array([5000], np.int64), np.array([1.0]), np.array([0], np.int32))
    with pytest.raises(ValueError, match="across chunks"):
        cleaner.feed(np.array([4000], np.int64), np.array([1.0]), np.array([0], np.int32))
    cleaner.finish()
    with pytest.raises(ValueError, match="already finished"):
        cleaner.finish()


# ---- causal cleaning ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 5, 20])
def test_causal_streaming_equals_whole_for_every_single_cut(k) -> None:
    ts, value, state = _adversarial_series()
    kw = {**CLEAN_KW, "hampel_k": k, "causal": True}
    whole = clean_series(ts, value, state, node_params(**kw))
    assert whole.counts["hampel_outlier"]
    for cut in range(0, len(ts) + 1):
        _assert_same(_stream(ts, value, state, [cut], **kw), whole)
    _assert_same(_stream(ts, value, state, list(range(1, len(ts))), **kw), whole)


def test_causal_cleaning_decides_each_point_with_the_points_before_it_only() -> None:
    """Every prefix of the series keeps and removes its points as the whole series does: a point's
    fate never waits for a later point (the centred filter's last k points do)."""
    ts, value, state = _adversarial_series(seed=11, n=250)
    kw = {**CLEAN_KW, "causal": True}
    whole = clean_series(ts, value, state, node_params(**kw))
    centred_whole = clean_series(ts, value, state, node_params(**CLEAN_KW))
    changed_centred = 0
    for n in range(1, len(ts) + 1):
        part = clean_series(ts[:n], value[:n], state[:n], node_params(**kw))
        # The last point's duplicate-group fate needs the next point only if it shares its ts.
        settled = ts[: n] < ts[n - 1] if n < len(ts) and ts[n] == ts[n - 1] else np.ones(n, bool)
        limit = ts[:n][settled][-1] if settled.any() else -1
        assert np.array_equal(part.ts[part.ts <= limit], whole.ts[whole.ts <= limit])
        assert np.array_equal(part.outlier_ts[part.outlier_ts <= limit], whole.outlier_ts[whole.outlier_ts <= limit])
        centred = clean_series(ts[:n], value[:n], state[:n], node_params(**CLEAN_KW))
        changed_centred += not np.array_equal(centred.outlier_ts, centred_whole.outlier_ts[centred_whole.outlier_ts <= ts[n - 1]])
    assert changed_centred > 0
