"""Per-node cleaning of one run's raw points (docs/spec.md, cleaning).

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
    The one-chunk form of :class:`SeriesCleaner`.
    """
    cleaner = SeriesCleaner(
        good_states=good_states,
        range_lo=range_lo,
        range_hi=range_hi,
        hampel_k=hampel_k,
        hampel_sigma=hampel_sigma,
        hampel_min_dev=hampel_min_dev,
    )
    first = cleaner.feed(ts, value, state)
    last = cleaner.finish()
    return CleanedSeries(
        ts=np.concatenate([first.ts, last.ts]),
        value=np.concatenate([first.value, last.value]),
        counts=cleaner.counts,
        outlier_ts=np.concatenate([first.outlier_ts, last.outlier_ts]),
        outlier_value=np.concatenate([first.outlier_value, last.outlier_value]),
    )


@dataclass(frozen=True, eq=False)
class CleanedChunk:
    """Points of a series whose fate is final: kept (in time order) and removed by Hampel."""

    ts: np.ndarray  # int64
    value: np.ndarray  # float64
    outlier_ts: np.ndarray  # int64
    outlier_value: np.ndarray  # float64


_NO_TS = np.empty(0, dtype=np.int64)
_NO_VALUE = np.empty(0, dtype=np.float64)


class SeriesCleaner:
    """:func:`clean_series` over a series fed in chunks of any size, with bounded memory.

    Each chunk's points must follow the previous chunk's in ``(ts, seq)`` order. The rules that
    look beyond one point carry exactly the state they need across a chunk boundary:

    * duplicate timestamps: the last survivor of a chunk is held back until a later survivor
      shows whether it is the last of its timestamp group (one point);
    * Hampel: a point's window is ``k`` survivors on each side, so the last ``k`` survivors wait
      for ``k`` more, and ``k`` resolved ones stay as left context (``2k`` points). A chunk's flags
      are computed on context + chunk, and taken only where the whole window lies inside it (or
      is clipped by the true start of the series); :meth:`finish` resolves the rest against the
      true end.

    So the kept points, the outliers and the counts are identical to the one-chunk result,
    wherever the chunks are cut (the tests cut at duplicates, outliers, bad states and every
    single point).
    """

    def __init__(
        self,
        *,
        good_states: Sequence[int],
        range_lo: float | None,
        range_hi: float | None,
        hampel_k: int,
        hampel_sigma: float,
        hampel_min_dev: float,
    ) -> None:
        good = np.asarray(list(good_states))
        if good.size == 0:
            raise ValueError("clean_series: good_states is empty, so every point would be dropped")
        if not np.issubdtype(good.dtype, np.integer):
            raise ValueError(f"clean_series: good_states must be integers, got {list(good_states)!r}")
        self._good = good
        self._lo = _bound("range_lo", range_lo)
        self._hi = _bound("range_hi", range_hi)
        if self._lo is not None and self._hi is not None and self._lo > self._hi:
            raise ValueError(f"clean_series: range_lo ({self._lo}) is greater than range_hi ({self._hi})")
        # Validates k, sigma and min_dev once, with hampel_outliers' own messages.
        hampel_outliers(np.empty(0), hampel_k, hampel_sigma, hampel_min_dev)
        self._k, self._sigma, self._min_dev = int(hampel_k), float(hampel_sigma), float(hampel_min_dev)
        self.counts: dict[str, int] = {"input": 0, **dict.fromkeys(CLEAN_CAUSES, 0), "kept": 0}
        self._last_ts: int | None = None  # last timestamp fed (order check across chunks)
        self._held_ts, self._held_value = _NO_TS, _NO_VALUE  # at most one survivor held back
        # Deduplicated survivors waiting for Hampel: the first ``_context`` are resolved context.
        self._buf_ts, self._buf_value = _NO_TS, _NO_VALUE
        self._context = 0
        self._finished = False

    def feed(self, ts: np.ndarray, value: np.ndarray, state: np.ndarray) -> CleanedChunk:
        """Clean the next chunk; returns the points whose fate this chunk decided."""
        if self._finished:
            raise ValueError("clean_series: the series was already finished")
        ts, value, state = self._checked(ts, value, state)
        n = int(ts.size)
        self.counts["input"] += n
        keep = np.isfinite(value)
        self.counts["non_finite"] += n - int(keep.sum())

        good = self._good
        if good.size <= 4:  # the usual case ([0]): a few comparisons beat np.isin's setup
            is_good = state == good[0]
            for g in good[1:]:
                is_good |= state == g
        else:
            is_good = np.isin(state, good)
        removed = keep & ~is_good
        self.counts["bad_state"] += int(removed.sum())
        keep &= ~removed

        # NaN compares false, but non-finite points are already gone; only kept points are charged.
        out = np.zeros(n, dtype=bool)
        if self._lo is not None:
            out |= value < self._lo
        if self._hi is not None:
            out |= value > self._hi
        removed = keep & out
        self.counts["out_of_range"] += int(removed.sum())
        keep &= ~removed

        # Duplicates are judged among survivors only: a bad point must not knock out a good one
        # that shares its timestamp. Input order is (ts, seq), so the last of a group has the
        # highest seq; the chunk's last survivor waits for the next chunk to know if it is last.
        idx = np.flatnonzero(keep)
        if idx.size:
            cand_ts = np.concatenate([self._held_ts, ts[idx]])
            cand_value = np.concatenate([self._held_value, value[idx]])
            last_of_group = cand_ts[:-1] != cand_ts[1:]
            self.counts["duplicate_ts"] += int(last_of_group.size - last_of_group.sum())
            self._held_ts, self._held_value = cand_ts[-1:], cand_value[-1:]
            self._push(cand_ts[:-1][last_of_group], cand_value[:-1][last_of_group])
        return self._resolve(final=False)

    def finish(self) -> CleanedChunk:
        """End of the series: resolve the held point and the Hampel tail."""
        if self._finished:
            raise ValueError("clean_series: the series was already finished")
        self._finished = True
        self._push(self._held_ts, self._held_value)
        self._held_ts, self._held_value = _NO_TS, _NO_VALUE
        return self._resolve(final=True)

    def _checked(self, ts, value, state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        back = np.flatnonzero(np.diff(ts) < 0)
        if back.size:
            i = int(back[0]) + 1
            raise ValueError(
                f"clean_series: timestamps must be ordered by (ts, seq); ts decreases at index {i} "
                f"({int(ts[i - 1])} -> {int(ts[i])})"
            )
        if ts.size and self._last_ts is not None and int(ts[0]) < self._last_ts:
            raise ValueError(
                "clean_series: timestamps must be ordered by (ts, seq) across chunks; a chunk starts "
                f"at {int(ts[0])}, before the previous chunk's last point at {self._last_ts}"
            )
        if ts.size:
            self._last_ts = int(ts[-1])
        return ts, value, state

    def _push(self, ts: np.ndarray, value: np.ndarray) -> None:
        if ts.size:
            self._buf_ts = np.concatenate([self._buf_ts, ts])
            self._buf_value = np.concatenate([self._buf_value, value])

    def _resolve(self, *, final: bool) -> CleanedChunk:
        """Hampel-judge the buffered survivors whose window is complete; keep the context."""
        k, n = self._k, int(self._buf_ts.size)
        end = n if final else max(self._context, n - k)
        if end <= self._context:
            return CleanedChunk(_NO_TS, _NO_VALUE, _NO_TS, _NO_VALUE)
        if k == 0:
            flags = np.zeros(n, dtype=bool)
        else:
            # Flags at i depend only on buffer[i-k .. i+k]: exact for context..end-1.
            flags = hampel_outliers(self._buf_value, k, self._sigma, self._min_dev)
        sl = slice(self._context, end)
        f = flags[sl]
        ts, value = self._buf_ts[sl], self._buf_value[sl]
        chunk = CleanedChunk(ts[~f], value[~f], ts[f], value[f])
        self.counts["hampel_outlier"] += int(f.sum())
        self.counts["kept"] += int((~f).sum())
        drop = max(0, end - k)  # keep k resolved points as the next windows' left context
        if drop:  # then context = k, so no kept flag comes from a window clipped at the buffer's start
            self._buf_ts, self._buf_value = self._buf_ts[drop:], self._buf_value[drop:]
        self._context = end - drop
        return chunk


def _bound(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    f = float(v)
    if math.isnan(f):
        raise ValueError(f"clean_series: {name} must be a number or None, got NaN")
    return f
