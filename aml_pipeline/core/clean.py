"""Per-node cleaning of one run's raw points (docs/spec.md, cleaning).

Rules apply in a fixed order and every removed point is charged to exactly one cause, the first
rule that removed it, so the counts always add up: ``input == sum(causes) + kept``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.core.hampel import hampel_outliers

CLEAN_CAUSES: tuple[str, ...] = ("non_finite", "bad_state", "out_of_range", "duplicate_ts", "hampel_outlier")


def point_removals(
    value: np.ndarray, state: np.ndarray, good: np.ndarray, lo: float | np.ndarray | None, hi: float | np.ndarray | None,
    *, outside: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rules that judge each point alone, in order, each removed point charged to the first
    rule that removes it: masks of the non-finite values, the states not in ``good``, and the
    values outside the inclusive ``[lo, hi]`` (``None``: open on that side; a bound may be one per
    point). ``outside``: the values outside their range, found by the caller (``lo`` and ``hi``
    are then not used; it is overwritten)."""
    non_finite = ~np.isfinite(value)
    if good.size <= 4:  # the usual case ([0]): a few comparisons beat np.isin's setup
        is_good = state == good[0]
        for g in good[1:]:
            is_good |= state == g
    else:
        is_good = np.isin(state, good)
    bad_state = ~non_finite & ~is_good
    # NaN compares false, but non-finite points are already charged; only the others are.
    if outside is not None:
        out = outside
    else:
        out = np.zeros(value.size, dtype=bool)
        if lo is not None:
            out |= value < lo
        if hi is not None:
            out |= value > hi
    out &= is_good
    out &= ~non_finite
    return non_finite, bad_state, out


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
    """One node's points cleaned by its :class:`~aml_pipeline.core.grid_params.NodeGridParams`, fed
    in chunks of any size, with bounded memory.

    Order: non-finite value; state not in ``good_states``; outside the inclusive ``valid_range``;
    duplicate timestamps (the last of each equal-ts group survives, i.e. the highest seq); Hampel
    outliers over what remains. Each chunk's points must follow the previous chunk's in
    ``(ts, seq)`` order. The rules that look beyond one point carry exactly the state they need
    across a chunk boundary:

    * duplicate timestamps: the last survivor of a chunk is held back until a later survivor
      shows whether it is the last of its timestamp group (one point);
    * Hampel: a point's window is ``k`` survivors on each side, so the last ``k`` survivors wait
      for ``k`` more, and ``k`` resolved ones stay as left context (``2k`` points). A chunk's flags
      are computed on context + chunk, and taken only where the whole window lies inside it (or
      is clipped by the true start of the series); :meth:`finish` resolves the rest against the
      true end. With ``params.causal`` the window is the point and the ``2k`` survivors before
      it (:func:`~aml_pipeline.core.hampel.hampel_outliers`, ``trailing``): nothing waits, and
      ``2k`` resolved points stay as context.

    So the kept points, the outliers and the counts are those of the whole series fed at once,
    wherever the chunks are cut (the tests cut at duplicates, outliers, bad states and every
    single point).
    """

    def __init__(self, params: NodeGridParams) -> None:
        self.params = params
        self._good = np.asarray(params.good_states)
        self._lo, self._hi = params.valid_range
        self._k, self._sigma, self._min_dev = params.hampel_k, params.hampel_sigma, params.hampel_min_dev
        self._trailing = params.causal
        # Survivors a flag waits for after its point, and resolved ones it needs before it.
        self._wait, self._reach_back = (0, 2 * self._k) if self._trailing else (self._k, self._k)
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
            raise ValueError("SeriesCleaner: the series was already finished")
        ts, value, state = self._checked(ts, value, state)
        n = int(ts.size)
        self.counts["input"] += n
        non_finite, bad_state, out_of_range = point_removals(value, state, self._good, self._lo, self._hi)
        for cause, removed in (("non_finite", non_finite), ("bad_state", bad_state), ("out_of_range", out_of_range)):
            self.counts[cause] += int(removed.sum())
        keep = ~(non_finite | bad_state | out_of_range)

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
            raise ValueError("SeriesCleaner: the series was already finished")
        self._finished = True
        self._push(self._held_ts, self._held_value)
        self._held_ts, self._held_value = _NO_TS, _NO_VALUE
        return self._resolve(final=True)

    def _checked(self, ts, value, state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ts = np.asarray(ts)
        value = np.asarray(value, dtype=np.float64)
        state = np.asarray(state)
        if ts.ndim != 1 or value.ndim != 1 or state.ndim != 1:
            raise ValueError("SeriesCleaner: ts, value and state must be 1-D")
        if not (ts.size == value.size == state.size):
            raise ValueError(
                f"SeriesCleaner: ts, value and state differ in length ({ts.size}, {value.size}, {state.size})"
            )
        if ts.size and not np.issubdtype(ts.dtype, np.integer):
            raise ValueError(f"SeriesCleaner: ts must be integer epoch ms, got dtype {ts.dtype}")
        if state.size and not np.issubdtype(state.dtype, np.integer):
            raise ValueError(f"SeriesCleaner: state must be integer, got dtype {state.dtype}")
        ts = ts.astype(np.int64, copy=False)
        back = np.flatnonzero(np.diff(ts) < 0)
        if back.size:
            i = int(back[0]) + 1
            raise ValueError(
                f"SeriesCleaner: timestamps must be ordered by (ts, seq); ts decreases at index {i} "
                f"({int(ts[i - 1])} -> {int(ts[i])})"
            )
        if ts.size and self._last_ts is not None and int(ts[0]) < self._last_ts:
            raise ValueError(
                "SeriesCleaner: timestamps must be ordered by (ts, seq) across chunks; a chunk starts "
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
        end = n if final else max(self._context, n - self._wait)
        if end <= self._context:
            return CleanedChunk(_NO_TS, _NO_VALUE, _NO_TS, _NO_VALUE)
        if k == 0:
            flags = np.zeros(n, dtype=bool)
        else:
            # Flags at i depend only on buffer[i-k .. i+k] (trailing: [i-2k .. i]): exact for
            # context..end-1.
            flags = hampel_outliers(self._buf_value, k, self._sigma, self._min_dev, trailing=self._trailing)
        sl = slice(self._context, end)
        f = flags[sl]
        ts, value = self._buf_ts[sl], self._buf_value[sl]
        chunk = CleanedChunk(ts[~f], value[~f], ts[f], value[f])
        self.counts["hampel_outlier"] += int(f.sum())
        self.counts["kept"] += int((~f).sum())
        drop = max(0, end - self._reach_back)  # resolved points kept as the next windows' left context
        if drop:  # then the context is whole, so no kept flag comes from a window clipped at the buffer's start
            self._buf_ts, self._buf_value = self._buf_ts[drop:], self._buf_value[drop:]
        self._context = end - drop
        return chunk



@dataclass(frozen=True, eq=False)
class BatchCleaned:
    """Per input point of :func:`clean_batch`: whether Hampel judged it (it passed every earlier
    rule) and whether it is kept."""

    judged: np.ndarray  # bool
    kept: np.ndarray  # bool
    # The rules that judge each point alone (:func:`point_removals`), for the counts per cause.
    non_finite: np.ndarray  # bool
    bad_state: np.ndarray  # bool
    out_of_range: np.ndarray  # bool

    def counts(self, starts: np.ndarray) -> list[dict[str, int]]:
        """Per series (rows ``starts[i] .. starts[i+1]-1``, as given to :func:`clean_batch`): the
        counts :class:`SeriesCleaner` keeps, ``input``, each of :data:`CLEAN_CAUSES` and ``kept``."""
        bounds = np.append(np.asarray(starts, dtype=np.int64), self.kept.size).tolist()
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            c = {m: int(np.count_nonzero(getattr(self, m)[a:b]))
                 for m in ("non_finite", "bad_state", "out_of_range", "judged", "kept")}
            out.append({
                "input": b - a, "non_finite": c["non_finite"], "bad_state": c["bad_state"], "out_of_range": c["out_of_range"],
                # Survivors of the rules above that are not the last of their timestamp group (the
                # causes are disjoint, and the judged points are those survivors' last ones).
                "duplicate_ts": b - a - c["non_finite"] - c["bad_state"] - c["out_of_range"] - c["judged"],
                "hampel_outlier": c["judged"] - c["kept"], "kept": c["kept"],
            })
        return out


def clean_batch(
    ts: np.ndarray, value: np.ndarray, state: np.ndarray, starts: np.ndarray, params: Sequence[NodeGridParams]
) -> BatchCleaned:
    """Several series back to back, each cleaned whole by its own parameters, with the rules and
    results of :class:`SeriesCleaner` fed the series in one piece: series ``i`` is rows
    ``starts[i] .. starts[i+1]-1`` in ``(ts, seq)`` order, cleaned by ``params[i]``.

    For many short series at once (a model's live input: every node's last minutes) in a few array
    operations, where a cleaner per series would spend most of its time on per-call overhead.
    """
    ts = np.asarray(ts, dtype=np.int64)
    value = np.asarray(value, dtype=np.float64)
    state = np.asarray(state)
    bounds = np.append(np.asarray(starts, dtype=np.int64), ts.size)
    if bounds.size - 1 != len(params) or (bounds.size and bounds[0] != 0) or np.any(np.diff(bounds) < 0):
        raise ValueError(f"clean_batch: starts must ascend from 0, one per series ({len(params)} params)")
    back = np.flatnonzero(ts[1:] < ts[:-1])
    if back.size:  # a series' first point may precede the last one's
        at = np.minimum(np.searchsorted(bounds, back + 1), bounds.size - 1)
        back = back[bounds[at] != back + 1]
    if back.size:
        i = int(back[0]) + 1
        raise ValueError(f"clean_batch: timestamps must be ordered by (ts, seq) within a series; ts decreases at index {i}")
    goods = {p.good_states for p in params}
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    if len(goods) == 1:
        # Each series' range compared on its own slice (a bound array of every point would cost
        # more than the comparisons), as float64 like the values.
        outside = np.zeros(ts.size, dtype=bool)
        for (a, b), p in zip(spans, params):
            lo, hi = p.valid_range
            part = outside[a:b]
            if lo is not None:
                np.less(value[a:b], np.float64(lo), out=part)
            if hi is not None:
                part |= value[a:b] > np.float64(hi)
        removed = point_removals(value, state, np.asarray(next(iter(goods))), None, None, outside=outside)
    else:  # per series (a spec's goodStates are spec-wide, so only a caller's own mix gets here)
        removed = tuple(np.zeros(ts.size, dtype=bool) for _ in range(3))
        for (a, b), p in zip(spans, params):
            lo, hi = (None if x is None else np.float64(x) for x in p.valid_range)
            for mask, part in zip(removed, point_removals(value[a:b], state[a:b], np.asarray(p.good_states), lo, hi)):
                mask[a:b] = part
    # Masks over the input, compressed where a rule needs the survivors side by side: boolean
    # selections cost a fraction of gathers by index at a run's size.
    candidate = ~(removed[0] | removed[1] | removed[2])
    cand_bounds = _bounds([np.count_nonzero(candidate[a:b]) for a, b in spans])
    every = int(cand_bounds[-1]) == ts.size
    cand_ts = ts if every else ts[candidate]
    # Of equal timestamps within a series, the last (the highest seq) survives; a series' last
    # candidate is always the last of its group.
    last = np.ones(cand_ts.size, dtype=bool)
    np.not_equal(cand_ts[:-1], cand_ts[1:], out=last[:-1])
    ends = cand_bounds[1:]
    last[ends[ends > cand_bounds[:-1]] - 1] = True
    if every:
        judged = last
    else:
        judged = np.zeros(ts.size, dtype=bool)
        judged[candidate] = last
    kept = judged.copy()
    groups: dict[tuple[int, float, float, bool], list[int]] = {}
    for i, p in enumerate(params):
        if p.hampel_k:
            groups.setdefault((p.hampel_k, p.hampel_sigma, p.hampel_min_dev, p.causal), []).append(i)
    # Each series' judged points are a slice of the judged ones, in order.
    judged_bounds = _bounds([np.count_nonzero(last[a:b]) for a, b in zip(cand_bounds[:-1].tolist(), cand_bounds[1:].tolist())])
    judged_idx = None
    for (k, sigma, min_dev, causal), members in groups.items():
        if len(members) == len(params):
            # One rule for every series (a spec's usual case): all judged points at once, in order.
            flags = hampel_outliers(value[judged], k, sigma, min_dev, trailing=causal, starts=judged_bounds[:-1])
            kept[judged] = ~flags
            continue
        parts = [(a, b) for a, b in (judged_bounds[i : i + 2].tolist() for i in members) if b > a]
        if not parts:
            continue
        if judged_idx is None:
            judged_idx = np.flatnonzero(judged)
        idx = judged_idx[parts[0][0] : parts[0][1]] if len(parts) == 1 else np.concatenate([judged_idx[a:b] for a, b in parts])
        first = np.cumsum([0] + [b - a for a, b in parts[:-1]])
        flags = hampel_outliers(value[idx], k, sigma, min_dev, trailing=causal, starts=first)
        kept[idx[flags]] = False
    return BatchCleaned(judged, kept, *removed)


def _bounds(counts: Sequence[int]) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: where each of consecutive parts of these sizes begins, and the end."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
