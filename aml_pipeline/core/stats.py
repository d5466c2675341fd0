"""Descriptive statistics for the build report (DESIGN 4.8): JSON-safe, NaN-aware, streamable.

The report covers every run of a dataset, and the build never holds all runs in memory, so each
statistic is an accumulator fed one run at a time (:class:`NodeSummary`, :class:`LagCorrelation`);
:func:`summarize` and :func:`lag_cross_correlation` are the one-shot forms of the same code. Moments
are merged with Chan et al.'s pairwise update, so batching changes results only by rounding.
Sums use numpy's pairwise summation, never a BLAS dot, so the report is identical across machines.
"""

from __future__ import annotations

import operator

import numpy as np

MIN_LAG_PAIRS = 10
"""Fewer valid difference pairs than this and a correlation is noise, so no lag is reported."""


class NodeSummary:
    """Streaming count of finite values, mean, population std, min, max and missing ratio."""

    def __init__(self) -> None:
        self.size = 0
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = np.inf
        self.max = -np.inf

    def add(self, values: np.ndarray) -> NodeSummary:
        v = np.asarray(values, dtype=np.float64).ravel()
        self.size += int(v.size)
        finite = v[np.isfinite(v)]
        n_b = int(finite.size)
        if n_b == 0:
            return self
        mean_b = float(finite.mean())
        m2_b = float(np.sum((finite - mean_b) ** 2))
        self.min = min(self.min, float(finite.min()))
        self.max = max(self.max, float(finite.max()))
        if self.count == 0:
            self.count, self.mean, self.m2 = n_b, mean_b, m2_b
            return self
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * (n_b / n)
        self.m2 += m2_b + delta * delta * (self.count * n_b / n)
        self.count = n
        return self

    def result(self) -> dict:
        """``{count, mean, std, min, max, missingRatio}``; None (JSON null) where there is no value.

        Non-finite values count as missing; an empty input has missingRatio 1.0, like
        ``grid.missing_ratio``.
        """
        out: dict = {
            "count": self.count,
            "mean": None,
            "std": None,
            "min": None,
            "max": None,
            "missingRatio": 1.0 if self.size == 0 else float(1.0 - self.count / self.size),
        }
        if self.count:
            out.update(
                mean=_json_float(self.mean),
                std=_json_float(np.sqrt(self.m2 / self.count)),
                min=self.min,
                max=self.max,
            )
        return out


def summarize(values: np.ndarray) -> dict:
    """One-shot :class:`NodeSummary` of ``values`` (any shape, flattened)."""
    return NodeSummary().add(values).result()


class LagCorrelation:
    """Streaming estimate of the lag (grid steps, 0..max_lag) at which a target follows a control.

    Correlates first differences (levels of plant signals trend together for reasons other than
    cause and effect; steps do not), pairing ``dc[i]`` with ``dt[i + lag]`` within one
    :meth:`add` call (one run: differences never span two runs) and ignoring pairs with a NaN.
    "Best" is the largest ``|corr|``, since a control may act with a negative gain (a cooling
    valve); the signed correlation is reported, ties go to the smaller lag.
    """

    def __init__(self, max_lag: int) -> None:
        try:
            if isinstance(max_lag, bool):
                raise TypeError
            max_lag = operator.index(max_lag)
        except TypeError:
            raise ValueError(f"max_lag must be an integer >= 0, got {max_lag!r}") from None
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        self.max_lag = max_lag
        size = max_lag + 1
        # Per lag: pair count, means, sums of squared deviations and the co-moment.
        self.n = np.zeros(size)
        self.mean_a = np.zeros(size)
        self.mean_b = np.zeros(size)
        self.m2_a = np.zeros(size)
        self.m2_b = np.zeros(size)
        self.c_ab = np.zeros(size)

    def add(self, control: np.ndarray, target: np.ndarray) -> LagCorrelation:
        c = np.asarray(control, dtype=np.float64)
        t = np.asarray(target, dtype=np.float64)
        if c.ndim != 1 or t.ndim != 1 or c.size != t.size:
            raise ValueError(
                f"control and target must be 1-D of equal length, got shapes {c.shape} and {t.shape}"
            )
        dc, dt = np.diff(c), np.diff(t)
        for lag in range(min(self.max_lag, dc.size - 1) + 1):
            a, b = dc[: dc.size - lag], dt[lag:]
            ok = np.isfinite(a) & np.isfinite(b)
            n_b = int(ok.sum())
            if n_b == 0:
                continue
            a, b = a[ok], b[ok]
            ma, mb = float(a.mean()), float(b.mean())
            da, db = a - ma, b - mb
            self._merge(
                lag, n_b, ma, mb, float(np.sum(da * da)), float(np.sum(db * db)), float(np.sum(da * db))
            )
        return self

    def _merge(self, lag: int, n_b: int, ma: float, mb: float, m2a: float, m2b: float, cab: float) -> None:
        n_a = self.n[lag]
        n = n_a + n_b
        delta_a, delta_b = ma - self.mean_a[lag], mb - self.mean_b[lag]
        w = n_a * n_b / n
        self.mean_a[lag] += delta_a * (n_b / n)
        self.mean_b[lag] += delta_b * (n_b / n)
        self.m2_a[lag] += m2a + delta_a * delta_a * w
        self.m2_b[lag] += m2b + delta_b * delta_b * w
        self.c_ab[lag] += cab + delta_a * delta_b * w
        self.n[lag] = n

    def result(self, beat_ms: int | None = None) -> dict:
        """``{"lagSteps", "lagMs", "corr", "pairs"}``.

        ``lagSteps``/``lagMs``/``corr`` are None when no lag has at least ``MIN_LAG_PAIRS`` valid
        pairs with non-zero variance on both sides (``pairs`` is then the largest pair count
        seen); ``lagMs`` is also None without ``beat_ms``.
        """
        best: tuple[float, int, float] | None = None  # (|corr|, lag, corr)
        for lag in range(self.max_lag + 1):
            if self.n[lag] < MIN_LAG_PAIRS or self.m2_a[lag] <= 0.0 or self.m2_b[lag] <= 0.0:
                continue
            corr = float(self.c_ab[lag] / np.sqrt(self.m2_a[lag] * self.m2_b[lag]))
            corr = max(-1.0, min(1.0, corr))
            if best is None or abs(corr) > best[0]:
                best = (abs(corr), lag, corr)
        if best is None:
            return {"lagSteps": None, "lagMs": None, "corr": None, "pairs": int(self.n.max())}
        lag = best[1]
        return {
            "lagSteps": lag,
            "lagMs": None if beat_ms is None else lag * int(beat_ms),
            "corr": best[2],
            "pairs": int(self.n[lag]),
        }


def lag_cross_correlation(control: np.ndarray, target: np.ndarray, max_lag: int) -> dict:
    """One-shot :class:`LagCorrelation`: ``{"lagSteps", "corr", "pairs"}`` for one pair of columns."""
    r = LagCorrelation(max_lag).add(control, target).result()
    del r["lagMs"]
    return r


def _json_float(x: float) -> float | None:
    f = float(x)
    return f if np.isfinite(f) else None
