"""Several short series cleaned and aligned in one call (the live path) give each series exactly
what the streaming classes give it alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aml_pipeline.core.clean import clean_batch
import aml_pipeline.core.grid as grid_module
from aml_pipeline.core.grid import align_batch
from aml_pipeline_tests.core.whole_series import clean_series, grid_column, node_params


def _series(rng: np.random.Generator, n: int, level: float):
    ts = np.cumsum(rng.choice([0, 100, 300, 900, 1000, 1000, 1300, 2500, 7000], size=n)).astype(np.int64) + 1_700_000_000_000
    value = level + np.cumsum(rng.normal(0, 0.2, n))
    value[rng.random(n) < 0.04] += rng.choice([-30.0, 30.0])
    value[rng.random(n) < 0.02] = np.nan
    value[rng.random(n) < 0.01] = 1e6
    state = np.where(rng.random(n) < 0.04, 3, 0).astype(np.int32)
    return ts, value, state


def _params(rng: np.random.Generator):
    return node_params(
        good_states=(0,), valid_range=(-500.0, 500.0) if rng.random() < 0.7 else (None, 400.0),
        hampel_k=int(rng.choice([0, 1, 3, 5])), hampel_sigma=3.0, hampel_min_dev=float(rng.choice([0.0, 0.1])),
        interp=str(rng.choice(["linear", "hold"])), max_interp_ms=int(rng.choice([1000, 2500, 5000])),
        aggregate=str(rng.choice(["point", "mean"])), causal=bool(rng.random() < 0.5),
    )


def _assert_cleaned_as_each_series_alone(cleaned, series, params) -> None:
    lengths = [s[0].size for s in series]
    starts = np.cumsum([0, *lengths[:-1]])
    ts = np.concatenate([s[0] for s in series])
    counts = cleaned.counts(starts)
    for j, ((t, v, s), p) in enumerate(zip(series, params)):
        a, b = starts[j], starts[j] + lengths[j]
        alone = clean_series(t, v, s, p)
        assert counts[j] == alone.counts and list(counts[j]) == list(alone.counts), j
        assert np.array_equal(ts[a:b][cleaned.kept[a:b]], alone.ts), j
        assert np.array_equal(np.sort(ts[a:b][cleaned.judged[a:b] & ~cleaned.kept[a:b]]), alone.outlier_ts), j


@pytest.mark.parametrize("block_cells", [None, 7])
@pytest.mark.parametrize("seed", range(6))
def test_batch_cleaning_and_alignment_equal_each_series_alone(seed: int, block_cells: int | None, monkeypatch) -> None:
    if block_cells is not None:  # long series' path: series by series, in blocks of rows
        monkeypatch.setattr(grid_module, "_ALIGN_BLOCK_CELLS", block_cells)
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(0, 200)) for _ in range(12)] + [0, 1]
    series = [_series(rng, n, 10.0 * j) for j, n in enumerate(lengths)]
    params = [_params(rng) for _ in lengths]
    params[1] = dataclasses.replace(params[0])  # two series through one kernel and one Hampel group
    starts = np.cumsum([0, *lengths[:-1]])
    ts, value, state = (np.concatenate([s[i] for s in series]) for i in range(3))
    cleaned = clean_batch(ts, value, state, starts, params)
    _assert_cleaned_as_each_series_alone(cleaned, series, params)
    # A grid from before the series' points, and one beginning among them (points before its first row).
    for first, beat, rows in ((1_700_000_000_000 - 3000, 1000, 400), (1_700_000_000_000 + 40_500, 500, 300)):
        got = align_batch(ts[cleaned.kept], value[cleaned.kept], np.searchsorted(np.flatnonzero(cleaned.kept), starts),
                          params, first, beat, rows)
        for j, ((t, v, s), p) in enumerate(zip(series, params)):
            column, _ = grid_column(t, v, s, first, beat, rows, p)
            assert got[j].tobytes() == column.tobytes(), (j, p, first)
        assert np.isfinite(got).any() and np.isnan(got).any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("removals", [True, False])
def test_batch_cleaning_with_one_rule_for_every_series_equals_each_series_alone(removals: bool, causal: bool) -> None:
    """A spec's usual case: every node cleaned by the same Hampel rule (all judged points in one
    call), with and without points the single-point rules remove; duplicate timestamps in both."""
    rng = np.random.default_rng(11)
    series = [_series(rng, n, 10.0 * j) for j, n in enumerate([150, 0, 1, 90, 200, 37, 64])]
    for j in (4, 6):  # a series starting at the timestamp the one before it ends at: not a duplicate
        t, v, st = series[j]
        series[j] = (t - t[0] + series[j - 1][0][-1], v, st)
    if not removals:
        series = [(t, np.where(np.isfinite(v) & (np.abs(v) < 400.0), v, 1.0), np.zeros_like(s)) for t, v, s in series]
    params = [node_params(good_states=(0,), valid_range=(-500.0, 500.0), hampel_k=3, hampel_sigma=3.0,
                          hampel_min_dev=0.0, causal=causal)] * len(series)
    ts, value, state = (np.concatenate([s[i] for s in series]) for i in range(3))
    assert np.any(np.diff(ts) == 0)  # duplicates to resolve
    cleaned = clean_batch(ts, value, state, np.cumsum([0, *[s[0].size for s in series][:-1]]), params)
    assert removals == bool(np.any(~cleaned.judged & (np.diff(ts, append=ts[-1] + 1) != 0)))
    assert np.any(cleaned.judged & ~cleaned.kept)  # Hampel flagged some
    _assert_cleaned_as_each_series_alone(cleaned, series, params)


def test_align_batch_allows_steps_back_only_between_series() -> None:
    """Each series starts anew (the next may begin before the last one ended, also after an empty
    series), but within a series the times must rise strictly."""
    p = node_params(good_states=(0,), valid_range=(None, None), hampel_k=0, hampel_sigma=3.0, hampel_min_dev=0.0,
                    interp="hold", max_interp_ms=5000, aggregate="point", causal=False)
    ts = np.array([1000, 2000, 3000, 1000, 2500, 500, 4000], dtype=np.int64)
    value = np.arange(ts.size, dtype=np.float64)
    starts = np.array([0, 3, 3, 5])  # series of 3, 0, 2 and 2 points
    got = align_batch(ts, value, starts, [p] * 4, 1000, 1000, 3)
    assert got[0].tolist() == [0.0, 1.0, 2.0] and np.isnan(got[1]).all()
    for bad, where in (([1000, 2000, 2000, 1000, 2500, 500, 4000], 2), ([1000, 2000, 3000, 1000, 900, 500, 4000], 4),
                       ([1000, 2000, 3000, 1000, 2500, 500, 400], 6)):
        with pytest.raises(ValueError, match=rf"ts\[{where - 1}\] = .*, ts\[{where}\] ="):
            align_batch(np.array(bad, dtype=np.int64), value, starts, [p] * 4, 1000, 1000, 3)
