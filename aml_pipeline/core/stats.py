"""Descriptive statistics for the build report (docs/snapshot.md, report.json): JSON-safe, NaN-aware, streamable.

The report covers every run of a dataset, and the build never holds all runs in memory, so each
statistic is an accumulator fed one run at a time (:class:`NodeSummary`, :class:`LagCorrelation`);
:func:`summarize` and :func:`lag_cross_correlation` are the one-shot forms of the same code. Moments
are merged with Chan et al.'s pairwise update, so batching changes results only by rounding.
Sums use numpy's pairwise summation or numpy's own FFT, never a BLAS dot, so the report is
identical across machines.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Hashable, Mapping

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
        return self.merge(NodeSummary.batch(values))

    @staticmethod
    def batch(values: np.ndarray) -> tuple[int, int, float, float, float, float]:
        """What :meth:`add` takes from ``values``: ``(size, count, mean, m2, min, max)`` of the
        batch alone, to :meth:`merge` later (batches of several threads, merged in their order)."""
        v = np.asarray(values, dtype=np.float64).ravel()
        finite = v[np.isfinite(v)]
        n_b = int(finite.size)
        if n_b == 0:
            return int(v.size), 0, 0.0, 0.0, np.inf, -np.inf
        mean_b = float(finite.mean())
        m2_b = float(np.sum((finite - mean_b) ** 2))
        return int(v.size), n_b, mean_b, m2_b, float(finite.min()), float(finite.max())

    def merge(self, batch: tuple[int, int, float, float, float, float]) -> NodeSummary:
        """Add a :meth:`batch`: exactly what :meth:`add` of its values gives."""
        size, n_b, mean_b, m2_b, lo, hi = batch
        self.size += size
        if n_b == 0:
            return self
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
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

    def add(self, control: np.ndarray, target: np.ndarray, first: int = 0) -> LagCorrelation:
        """Add the pairs of one run, or of a block of one: with ``first > 0`` only the pairs whose
        target difference has index >= ``first`` (the earlier ones belong to the previous block,
        whose last rows this block repeats as context)."""
        c = np.asarray(control, dtype=np.float64)
        t = np.asarray(target, dtype=np.float64)
        if c.ndim != 1 or t.ndim != 1 or c.size != t.size:
            raise ValueError(
                f"control and target must be 1-D of equal length, got shapes {c.shape} and {t.shape}"
            )
        top, size = _lag_plan(self.max_lag, c.size)
        if top >= 0:
            self._add_spectra(_LagSeries(c, size), _LagSeries(t, size, first), top, size)
        return self

    def _add_spectra(self, a: _LagSeries, b: _LagSeries, top: int, size: int) -> None:
        """Add the pairs ``(a.d[i], b.d[i + lag])`` for lags ``0..top`` (both sides prepared
        for the same FFT ``size``)."""
        batch = _spectra_batch(a, b, top, size)
        if batch is not None:
            self._merge(*batch)

    def merge(self, batch: LagBatch | None) -> None:
        """Add a batch of :func:`lag_pair_batches`: exactly what the :meth:`add` it stands for gives."""
        if batch is not None:
            self._merge(*batch)

    def _merge(
        self,
        lags: np.ndarray,
        n_b: np.ndarray,
        ma: np.ndarray,
        mb: np.ndarray,
        m2a: np.ndarray,
        m2b: np.ndarray,
        cab: np.ndarray,
    ) -> None:
        """Chan et al.'s pairwise update of the moments at ``lags`` with a batch's."""
        n_a = self.n[lags]
        n = n_a + n_b
        delta_a, delta_b = ma - self.mean_a[lags], mb - self.mean_b[lags]
        w = n_a * n_b / n
        self.mean_a[lags] += delta_a * (n_b / n)
        self.mean_b[lags] += delta_b * (n_b / n)
        self.m2_a[lags] += np.maximum(m2a, 0.0) + delta_a * delta_a * w
        self.m2_b[lags] += np.maximum(m2b, 0.0) + delta_b * delta_b * w
        self.c_ab[lags] += cab + delta_a * delta_b * w
        self.n[lags] = n

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


# One batch of a LagCorrelation: the lags it has pairs at, and per such lag its pair count, means,
# sums of squared deviations and co-moment.
LagBatch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


# The six cross-correlations of a pair, as (row of a's spectrum, row of b's): rows 0, 1, 2 are
# the shifted differences, their squares and the validity mask. In order: pair count, sum of a,
# sum of b, sum of a^2, sum of b^2, sum of a*b.
_PRODUCTS = ((2, 2), (0, 2), (2, 0), (1, 2), (2, 1), (0, 0))


def _spectra_batch(a: _LagSeries, b: _LagSeries, top: int, size: int,
                   shared: dict[tuple, np.ndarray] | None = None) -> LagBatch | None:
    """The moments of the pairs ``(a.d[i], b.d[i + lag])`` for lags ``0..top`` (both sides
    prepared for the same FFT ``size``); None when there is no pair.

    ``shared`` (one per set of columns) keeps the cross-correlations that other pairs have too:
    one side's mask with the other side's values is the same for every series with that mask,
    so it is transformed once. Each row is the same inverse FFT of the same product, so the
    result is the same to the bit.
    """
    if a.empty or b.empty:
        return None
    fa, fb = a.conj_spectrum, b.spectrum
    # sum_i p[i] q[i + lag] = irfft(conj(P) * Q)[lag]
    if shared is None:
        s = np.fft.irfft(np.stack([fa[i] * fb[j] for i, j in _PRODUCTS]), size)[:, : top + 1]
    else:
        keys = [(a.mask if i == 2 else id(a), b.mask if j == 2 else id(b), i, j, top)
                for i, j in _PRODUCTS]
        todo = [(k, ij) for k, ij in zip(keys, _PRODUCTS) if k not in shared]
        if todo:
            products = np.empty((len(todo), fa.shape[1]), dtype=np.result_type(fa, fb))
            for row, (_, (i, j)) in zip(products, todo):
                np.multiply(fa[i], fb[j], out=row)
            shared.update(zip((k for k, _ in todo), np.fft.irfft(products, size)[:, : top + 1]))
        s = [shared[k] for k in keys]
    count = np.rint(s[0])
    used = count > 0
    if not used.any():
        return None
    lags = np.flatnonzero(used)
    n_b = count[used]
    sa, sb, saa, sbb, sab = (row[used] for row in s[1:])
    m2a = saa - sa * sa / n_b
    m2b = sbb - sb * sb / n_b
    cab = sab - sa * sb / n_b
    # What the FFT's rounding can leave of a variance that is truly 0 is far below this.
    noise = 64.0 * np.finfo(np.float64).eps * math.log2(size) * math.sqrt(a.n)
    m2a[m2a <= noise * a.energy] = 0.0
    m2b[m2b <= noise * b.energy] = 0.0
    return lags, n_b, a.ref + sa / n_b, b.ref + sb / n_b, m2a, m2b, cab


def lag_cross_correlation(control: np.ndarray, target: np.ndarray, max_lag: int) -> dict:
    """One-shot :class:`LagCorrelation`: ``{"lagSteps", "corr", "pairs"}`` for one pair of columns."""
    r = LagCorrelation(max_lag).add(control, target).result()
    del r["lagMs"]
    return r


class _LagSeries:
    """One side of the lag correlation: first differences of a column, prepared for the FFT.

    The six sums over the valid pairs ``(dc[i], dt[i + lag])`` of every lag are
    cross-correlations of the zero-filled differences (and their squares) with the validity
    masks, computed by FFT in O(n log n) rather than O(n * max_lag). Differences are shifted by
    their median first, so the raw sums do not cancel, and a constant series is exactly zero
    (its variance exactly 0).
    """

    __slots__ = ("n", "empty", "ref", "energy", "spectrum", "mask", "_conj")

    def __init__(self, column: np.ndarray, size: int, first: int = 0) -> None:
        d = np.diff(column)
        ok = np.isfinite(d)
        ok[:first] = False  # a target side that starts with context rows of the previous block
        self.n = d.size
        self.empty = not ok.any()
        self.ref = float(np.median(d[ok])) if not self.empty else 0.0
        shifted = np.subtract(d, self.ref, where=ok, out=np.zeros_like(d))
        sq = shifted * shifted
        self.energy = float(sq.sum())
        self.spectrum = np.fft.rfft(np.stack([shifted, sq, ok.astype(np.float64)]), size)
        # Which differences are valid: series with equal masks have the same mask spectrum.
        self.mask = (size, ok.tobytes())
        self._conj: np.ndarray | None = None

    @property
    def conj_spectrum(self) -> np.ndarray:
        if self._conj is None:
            self._conj = np.conjugate(self.spectrum)
        return self._conj


def _lag_plan(max_lag: int, length: int) -> tuple[int, int]:
    """Largest usable lag for a column of ``length`` values, and the FFT size (zero padding of
    at least that many samples, so no circular wrap-around reaches lags ``0..top``)."""
    top = min(max_lag, length - 2)
    return top, _fft_size(max(length - 1, 0) + max(top, 0))


def add_lag_pairs(
    accumulators: Mapping[tuple[Hashable, Hashable], LagCorrelation],
    columns: Mapping[Hashable, np.ndarray],
    first: int = 0,
) -> None:
    """``acc.add(columns[c], columns[t], first)`` for every ``(c, t): acc``, each column's FFT done once.

    Gives exactly what the pairwise calls give; a report with many control/target pairs pays
    for each column once instead of once per pair.
    """
    for key, batch in lag_pair_batches({k: acc.max_lag for k, acc in accumulators.items()}, columns, first):
        accumulators[key].merge(batch)


def lag_pair_batches(
    max_lags: Mapping[tuple[Hashable, Hashable], int],
    columns: Mapping[Hashable, np.ndarray],
    first: int = 0,
) -> list[tuple[tuple[Hashable, Hashable], LagBatch | None]]:
    """What :func:`add_lag_pairs` adds to each accumulator (``max_lags``: each pair's
    ``max_lag``), without one: ``(pair, batch)`` in ``max_lags``' order, for
    :meth:`LagCorrelation.merge`. Nothing here reads an accumulator, so the batches of several
    blocks can be computed at once (threads) and merged in the blocks' order."""
    prepared: dict[tuple[Hashable, int, int], _LagSeries] = {}
    shared: dict[tuple, np.ndarray] = {}
    out: list[tuple[tuple[Hashable, Hashable], LagBatch | None]] = []
    for (c, t), max_lag in max_lags.items():
        a, b = np.asarray(columns[c], dtype=np.float64), np.asarray(columns[t], dtype=np.float64)
        if a.ndim != 1 or b.ndim != 1 or a.size != b.size:
            raise ValueError(
                f"control and target must be 1-D of equal length, got shapes {a.shape} and {b.shape}"
            )
        top, size = _lag_plan(max_lag, a.size)
        if top < 0:
            continue
        # Controls are the left side of a pair (never masked), targets the right side.
        for key in ((c, size, 0), (t, size, first)):
            if key not in prepared:
                prepared[key] = _LagSeries(np.asarray(columns[key[0]], dtype=np.float64), size, key[2])
        out.append(((c, t), _spectra_batch(prepared[(c, size, 0)], prepared[(t, size, first)], top, size, shared)))
    return out


# A report asks for the same few sizes for every pair of columns of every block: the search
# (a few hundred Python steps) is done once per size.
@functools.lru_cache(maxsize=256)
def _fft_size(n: int) -> int:
    """The smallest 2^i 3^j 5^k >= n (sizes numpy's FFT handles fastest)."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            size = p35 << max(0, (-(-n // p35) - 1).bit_length())  # p35 * 2^i >= n
            best = min(best, size)
            p35 *= 3
        p5 *= 5
    return best


def _json_float(x: float) -> float | None:
    f = float(x)
    return f if np.isfinite(f) else None
