"""bench.timing: alternating repetitions, summaries and paired ratios."""

from __future__ import annotations

import itertools

import pytest

from bench.timing import Sample, ratio_of, side_by_side, summarize, timed


def test_summarize_median_min_max_and_all():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "repeat": 4, "all": [3.0, 1.0, 2.0, 10.0]}
    with pytest.raises(ValueError, match="no measurements"):
        summarize([])


def test_sides_alternate_and_rotate():
    calls: list[str] = []
    prepared: list[tuple[str, int]] = []
    cmp = side_by_side(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "c": lambda: calls.append("c")},
        repeat=4,
        prepare=lambda side, i: prepared.append((side, i)),
    )
    assert calls == list("abc" "bca" "cab" "abc")
    assert cmp.order == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert prepared == [(s, i) for i, order in enumerate(cmp.order) for s in order]
    assert cmp.repeat == 4 and all(len(v) == 4 for v in cmp.seconds.values())


def test_fixed_order_for_dependent_sides():
    calls: list[str] = []
    side_by_side({"full": lambda: calls.append("full"), "noop": lambda: calls.append("noop")}, repeat=3, rotate=False)
    assert calls == ["full", "noop"] * 3


def test_sample_carries_its_own_seconds_and_metrics():
    secs = itertools.count(1)
    rss = iter([100.0, 300.0, 110.0, 330.0])

    def side():
        return Sample(float(next(secs)), value="v", metrics={"peak_rss_mb": next(rss)})

    cmp = side_by_side({"short": side, "long": side}, repeat=2)
    # rep 0: short (1 s, 100), long (2 s, 300); rep 1 (rotated): long (3 s, 110), short (4 s, 330)
    assert cmp.seconds == {"short": [1.0, 4.0], "long": [2.0, 3.0]}
    assert cmp.metrics["long"]["peak_rss_mb"] == [300.0, 110.0]
    assert cmp.values == {"short": "v", "long": "v"}
    r = cmp.ratio("long", "short", metric="peak_rss_mb")
    assert r["value"] == pytest.approx(205.0 / 215.0)
    assert r["min"] == pytest.approx(110.0 / 330.0) and r["max"] == pytest.approx(3.0)
    j = cmp.to_json()
    assert j["repeat"] == 2 and j["long"]["peak_rss_mb"]["median"] == 205.0 and j["short"]["seconds"]["all"] == [1.0, 4.0]


def test_ratio_is_of_medians_with_paired_extremes():
    r = ratio_of([2.0, 4.0, 9.0], [1.0, 4.0, 3.0])
    assert r["value"] == 4.0 / 3.0
    assert (r["min"], r["max"], r["repeat"]) == (1.0, 3.0, 3)
    with pytest.raises(ValueError, match="same number"):
        ratio_of([1.0], [1.0, 2.0])


def test_rate_ratio_and_difference():
    it = iter([2.0, 1.0, 1.0, 4.0])  # rep 0: fast 2 s, slow 1 s; rep 1: slow 1 s, fast 4 s
    cmp = side_by_side({"fast": lambda: Sample(next(it)), "slow": lambda: Sample(next(it))}, repeat=2)
    assert cmp.seconds == {"fast": [2.0, 4.0], "slow": [1.0, 1.0]}
    # 100 units in `fast`'s time vs 10 units in `slow`'s
    rr = cmp.rate_ratio("fast", "slow", 100, 10)
    assert rr["value"] == pytest.approx((100 / 3.0) / (10 / 1.0))
    assert rr["min"] == pytest.approx((100 / 4.0) / 10) and rr["max"] == pytest.approx((100 / 2.0) / 10)
    assert rr["paired"] == pytest.approx([(100 / 2.0) / 10, (100 / 4.0) / 10])
    d = cmp.difference("fast", "slow")
    assert (d["value"], d["min"], d["max"]) == (2.0, 1.0, 3.0)


def test_metric_must_be_reported_every_repetition():
    flip = iter([True, False])
    with pytest.raises(ValueError, match="metric 'x' in 1 of 2"):
        side_by_side({"a": lambda: Sample(0.1, metrics={"x": 1.0} if next(flip) else {})}, repeat=2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        timed(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="no sides"):
        side_by_side({}, repeat=1)


def test_wall_time_is_measured_around_the_call():
    import time

    cmp = timed(lambda: time.sleep(0.02), repeat=2)
    assert all(t >= 0.02 for t in cmp.seconds["only"])
