"""Per-node cleaning of one run's raw points (DESIGN 4.2).

Rules apply in a fixed order and every removed point is charged to exactly one cause, the first
rule that removed it, so the counts always add up: ``input == sum(causes) + kept``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aml_pipeline.core.hampel import hampel_outliers

CLEAN_CAUSES: tuple[str, ...] = ("non_finite", "bad_state", "out_of_range", "duplicate_ts", "hampel_outlier")


@dataclass(frozen=True, eq=False)  # eq on numpy fields would be ambiguous
class CleanedSeries:
    ts: np.ndarray  # int64, strictly increasing
    value: np.ndarray  # float64, finite
    counts: dict[str, int]  # "input", each of CLEAN_CAUSES, "kept"
    outlier_ts: np.ndarray  # int64: the points Hampel removed (for raw-vs-cleaned plots)
    outlier_value: np.ndarray  # float64


def clean_series(
    ts: np.ndarray,
    value: np.ndarray,
    state: np.ndarray,
    *,
    good_states: Sequence[int],
    range_lo: float | None,
    range_hi: float | None,
    hampel_k: int,
    hampel_sigma: float,
    hampel_min_dev: float,
) -> CleanedSeries:
    """Clean one node's points, given in ``(ts, seq)`` ascending order.

    Order: non-finite value; state not in ``good_states``; outside the inclusive
    ``[range_lo, range_hi]`` (None = unbounded on that side); duplicate timestamps (the last of
    each equal-ts group survives, i.e. the highest seq); Hampel outliers over what remains.
    """
    ts = np.asarray(ts)
    value = np.asarray(value, dtype=np.float64)
    state = np.asarray(state)
    if ts.ndim != 1 or value.ndim != 1 or state.ndim != 1:
        raise ValueError("clean_series: ts, value and state must be 1-D")
    if not (ts.size == value.size == state.size):
        raise ValueError(
            f"clean_series: ts, value and state differ in length ({ts.size}, {value.size}, {state.size})"
        )
    if ts.size and not np.issubdtype(ts.dtype, np.integer):
        raise ValueError(f"clean_series: ts must be integer epoch ms, got dtype {ts.dtype}")
    if state.size and not np.issubdtype(state.dtype, np.integer):
        raise ValueError(f"clean_series: state must be integer, got dtype {state.dtype}")
    ts = ts.astype(np.int64, copy=False)
    good = np.asarray(list(good_states))
    if good.size == 0:
        raise ValueError("clean_series: good_states is empty, so every point would be dropped")
    if not np.issubdtype(good.dtype, np.integer):
        raise ValueError(f"clean_series: good_states must be integers, got {list(good_states)!r}")
    lo = _bound("range_lo", range_lo)
    hi = _bound("range_hi", range_hi)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clean_series: range_lo ({lo}) is greater than range_hi ({hi})")
    back = np.flatnonzero(np.diff(ts) < 0)
    if back.size:
        i = int(back[0]) + 1
        raise ValueError(
            f"clean_series: timestamps must be ordered by (ts, seq); ts decreases at index {i} "
            f"({int(ts[i - 1])} -> {int(ts[i])})"
        )

    n = int(ts.size)
    counts: dict[str, int] = {"input": n}
    keep = np.isfinite(value)
    counts["non_finite"] = n - int(keep.sum())

    if good.size <= 4:  # the usual case ([0]): a few comparisons beat np.isin's setup
        is_good = state == good[0]
        for g in good[1:]:
            is_good |= state == g
    else:
        is_good = np.isin(state, good)
    removed = keep & ~is_good
    counts["bad_state"] = int(removed.sum())
    keep &= ~removed

    # NaN compares false, but non-finite points are already gone; only kept points are charged.
    out = np.zeros(n, dtype=bool)
    if lo is not None:
        out |= value < lo
    if hi is not None:
        out |= value > hi
    removed = keep & out
    counts["out_of_range"] = int(removed.sum())
    keep &= ~removed

    # Duplicates are judged among survivors only: a bad point must not knock out a good one that
    # shares its timestamp. Input order is (ts, seq), so the last of a group has the highest seq.
    idx = np.flatnonzero(keep)
    last_of_group = np.ones(idx.size, dtype=bool)
    last_of_group[:-1] = ts[idx[:-1]] != ts[idx[1:]]
    counts["duplicate_ts"] = int(idx.size - last_of_group.sum())
    idx = idx[last_of_group]

    outliers = hampel_outliers(value[idx], hampel_k, hampel_sigma, hampel_min_dev)
    counts["hampel_outlier"] = int(outliers.sum())
    out_idx = idx[outliers]
    idx = idx[~outliers]
    counts["kept"] = int(idx.size)

    return CleanedSeries(
        ts=ts[idx],
        value=value[idx],
        counts=counts,
        outlier_ts=ts[out_idx],
        outlier_value=value[out_idx],
    )


def _bound(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    f = float(v)
    if math.isnan(f):
        raise ValueError(f"clean_series: {name} must be a number or None, got NaN")
    return f
