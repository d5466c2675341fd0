"""Hampel outlier filter with exact numpy-median semantics, vectorised.

Contract (docs/spec.md, cleaning): for point ``i`` the window is indices ``max(0, i-k)..min(n-1, i+k)`` (it
shrinks at the ends), ``m_i`` = median of the window (even counts average the middle two),
``MAD_i`` = median of ``|x_j - m_i|`` over the same window, and ``i`` is an outlier iff
``|x_i - m_i| > max(sigma * 1.4826 * MAD_i, min_dev)``.

The *trailing* variant (a causal dataset's, docs/spec.md) judges a point by the point and the
``2k`` before it only, ``max(0, i-2k)..i``. The median of a window that ends at the point lags a
drifting value by ``k`` points, so the level is the median of the window's newest half instead,
the point and the ``k`` before it, at least three points (``max(0, i-h+1)..i`` with
``h = max(3, k+1)``, so a single spike never moves it), and ``MAD_i`` the median of
``|x_j - m_i|`` over the whole window. The window holds the same ``2k+1`` points as the centred window of
``i-k``, so both share the interior kernels below; the trailing variant adds the newest half's
median, and its start edge is its only one (the first ``2k`` points).

The flags must be bit-identical to a straightforward per-point implementation, so nothing here
approximates: every value that reaches a comparison is produced by the same IEEE operations the
reference performs (min/max only permute values; ``m - s_j`` equals ``|s_j - m|`` exactly for
``s_j <= m``; the threshold is ``(sigma * 1.4826) * mad`` as Python evaluates it left to right).

How it stays fast without a Python loop per point:

* Interior points (full ``2k+1`` window) are sorted column-wise: the window of every point in a
  block is the ``2k+1`` shifted, zero-copy views of ``x``, and a sorting network of
  ``np.minimum``/``np.maximum`` over those columns sorts all windows of the block at once. Blocks
  are sized so the working set stays in L2. The network is compiled once per ``k`` into a fixed
  register program so the per-block cost is just the ufunc calls.
* MAD needs no second sort: in the sorted window ``s``, the ``k+1`` smallest deviations from any
  level ``m`` always come from a run ``s_a..s_{a+k}``, so
  ``MAD = min_{a=0..k} max(m - s_a, s_{a+k} - m)`` (for the window's own median, the run contains
  it). The trailing level is the middle of the newest ``k+1`` views sorted by a network of its own.
* Wide windows (where a network would need hundreds of comparators) and short series (where
  the fixed cost of ~100 ufunc calls dominates) use ``np.sort`` over a ``sliding_window_view``
  in blocks, with the same MAD formula.
* The ``2k`` edge points, whose windows are shorter and may have even length, are done with a
  NaN-padded matrix sorted row-wise (NaN sorts last), which reproduces numpy's even-count median.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAD_SCALE = 1.4826
"""Consistency constant making ``MAD_SCALE * MAD`` estimate the standard deviation of a normal."""

# Largest window (2k+1) sorted by a network. Above it the comparator count (~w log^2 w) makes a
# row-wise np.sort cheaper (bench/hampel_bench.py finds the crossover).
_NETWORK_MAX_WINDOW = 41
# A network costs a fixed call overhead per comparator whatever the length, so short series are
# cheaper with a row-wise sort, below about 2 * w**2 interior points.
_NETWORK_MIN_POINTS_PER_W2 = 2
# The network's live buffers (about 2k+4 float64 columns of one block) should stay in L2; blocks
# much below 2K points pay more in ufunc call overhead than they gain in cache hits.
_NETWORK_BLOCK_BYTES = 3 << 19
_MIN_BLOCK, _MAX_BLOCK = 2048, 16384
# Elements per np.sort call for the wide-window and edge paths (bounds temporary memory).
_SORT_CHUNK_ELEMENTS = 1 << 20


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators ``(i, j)``, ``i < j``, that sort ``n`` wires ascending (min to ``i``).

    Batcher's merge-exchange (Knuth, TAOCP 5.2.2, Algorithm M), which works for any ``n`` without
    padding to a power of two: 35 comparators is optimal for 11 inputs, this gives 37.
    """
    if n < 2:
        return ()
    out: list[tuple[int, int]] = []
    t = (n - 1).bit_length()
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            out.extend((i, i + d) for i in range(n - d) if (i & p) == r)
            if q == p:
                break
            d, q, r = q - p, q >> 1, p
        p >>= 1
    return tuple(out)


def hampel_outliers(
    x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0, *, trailing: bool = False,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """Boolean mask of Hampel outliers (True = outlier) of the 1-D finite series ``x``.

    ``k`` is the half window (0 disables the filter), ``sigma`` the threshold in robust standard
    deviations, ``min_dev`` an absolute floor on the threshold (quantised sensors have MAD 0 on
    plateaus and would otherwise flag every single step). ``trailing``: judge each point against
    itself and the ``2k`` points before it (nothing after it), so a flag never depends on a later
    point. ``starts``: ``x`` holds several series back to back, each beginning at one of these
    ascending indices (the first 0); windows never reach across from one to the next, so the flags
    are each series' own (several short series in one call cost about what one long one does).
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"hampel_outliers: x must be 1-D, got shape {x.shape}")
    if isinstance(k, bool):
        raise ValueError("hampel_outliers: k must be an integer, got a bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"hampel_outliers: k must be an integer, got {k!r}") from None
    if k < 0:
        raise ValueError(f"hampel_outliers: k must be >= 0, got {k}")
    sigma, min_dev = float(sigma), float(min_dev)
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"hampel_outliers: sigma must be finite and >= 0, got {sigma}")
    if not (math.isfinite(min_dev) and min_dev >= 0.0):
        raise ValueError(f"hampel_outliers: min_dev must be finite and >= 0, got {min_dev}")
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise ValueError(
            f"hampel_outliers: x must be finite (remove non-finite values first); x[{bad}] = {x[bad]}"
        )
    n = x.size
    flags = np.zeros(n, dtype=bool)
    if k == 0 or n == 0:
        return flags
    bounds = _segment_bounds(starts, n)

    # Python evaluates `sigma * 1.4826 * mad` as `(sigma * 1.4826) * mad`; multiplying by this
    # product keeps the threshold bit-identical to the reference.
    scale = sigma * MAD_SCALE
    # The full windows are centred on k..n-k-1; a trailing window's point is its last, k further on.
    shift = k if trailing else 0
    if n > 2 * k:
        w = 2 * k + 1
        if w <= _NETWORK_MAX_WINDOW and n - 2 * k >= _NETWORK_MIN_POINTS_PER_W2 * w * w:
            _interior_network(x, k, scale, min_dev, flags, shift)
        else:
            _interior_sorted(x, k, scale, min_dev, flags, shift)
    # The points whose window a series' start or end cuts short (all windows that reach across
    # from one series to the next among them) are judged again on their own windows.
    idx, first, last = _edge_windows(bounds, k, trailing)
    _edges(x, idx, first, last, scale, min_dev, flags, np.maximum(first, idx - trailing_level(k) + 1) if trailing else None)
    return flags


def trailing_level(k: int) -> int:
    """How many of a trailing window's newest points give its level: the point and the ``k``
    before it, at least three (with two, a spike would pull the level halfway to itself)."""
    return max(3, k + 1)


def _segment_bounds(starts: np.ndarray | None, n: int) -> np.ndarray:
    """``[s0 = 0, s1, ..., n]``: where each series of ``x`` begins, and its end."""
    if starts is None:
        return np.array([0, n])
    b = np.asarray(starts)
    if b.ndim != 1 or (b.size and not np.issubdtype(b.dtype, np.integer)):
        raise ValueError("hampel_outliers: starts must be a 1-D array of integer indices")
    b = b.astype(np.int64)
    if b.size == 0 or b[0] != 0 or np.any(np.diff(b) < 0) or b[-1] > n:
        raise ValueError(f"hampel_outliers: starts must ascend from 0 and stay within the {n} points")
    return np.append(b, n)


def _edge_windows(bounds: np.ndarray, k: int, trailing: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Points whose window is cut short by their series' ends, with each window's first and last
    index: centred, a series' first and last ``k`` (all of it when it has ``2k`` points or fewer);
    trailing, its first ``2k``, whose window is everything before them."""
    idx, lo, hi = [], [], []
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # one step per series, not per point
        if e <= s:
            continue
        if trailing:
            i = np.arange(s, min(e, s + 2 * k))
            idx.append(i), lo.append(np.full(i.size, s)), hi.append(i)
            continue
        i = np.arange(s, e) if e - s <= 2 * k else np.concatenate([np.arange(s, s + k), np.arange(e - k, e)])
        idx.append(i), lo.append(np.maximum(i - k, s)), hi.append(np.minimum(i + k, e - 1))
    if not idx:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(idx), np.concatenate(lo), np.concatenate(hi)


# --- interior: sorting network over shifted views ---------------------------------------------


@functools.lru_cache(maxsize=64)
def _network_program(w: int) -> tuple[tuple[tuple[bool, int, int, int], ...], tuple[int, ...], int]:
    """Compile the network for ``w`` wires into register operations.

    Registers ``0..w-1`` hold the (read-only) input views, ``w..`` scratch buffers. Each step is
    ``(is_min, a, b, out)``. Buffers are recycled so at most ``w + 1`` are live; returns the
    steps, the register holding sorted wire ``j``, and the number of scratch buffers.
    """
    reg = list(range(w))  # wire -> register
    free: list[int] = []
    n_scratch = 0

    def take() -> int:
        nonlocal n_scratch
        if free:
            return free.pop()
        n_scratch += 1
        return w + n_scratch - 1

    steps: list[tuple[bool, int, int, int]] = []
    for i, j in sorting_network(w):
        ra, rb = reg[i], reg[j]
        lo = take()
        steps.append((True, ra, rb, lo))
        # The max may overwrite an input we own: both inputs are read before the output is
        # written element by element, and the min has already been saved elsewhere.
        if rb >= w:
            hi = rb
            if ra >= w:
                free.append(ra)
        elif ra >= w:
            hi = ra
        else:
            hi = take()
        steps.append((False, ra, rb, hi))
        reg[i], reg[j] = lo, hi
    # The MAD stage works in place on the sorted columns, so none may still be a view of x. A
    # sorting network must touch every wire (w >= 2), so this only guards against a broken one.
    if any(r < w for r in reg):
        raise AssertionError(f"sorting network for {w} wires leaves a wire untouched")
    return tuple(steps), tuple(reg), n_scratch


def _interior_network(x: np.ndarray, k: int, scale: float, min_dev: float, flags: np.ndarray, shift: int) -> None:
    n, w = x.size, 2 * k + 1
    steps, sorted_reg, n_scratch = _network_program(w)
    first, stop = k, n - k
    block = int(min(_MAX_BLOCK, max(_MIN_BLOCK, _NETWORK_BLOCK_BYTES // (8 * (w + 3)))))
    block = min(block, stop - first)  # short series: don't allocate (and page-fault) unused buffers
    scratch = [np.empty(block) for _ in range(n_scratch)]
    dev = np.empty(block)
    regs: list[np.ndarray] = [x] * w + scratch
    for b0 in range(first, stop, block):
        b1 = min(b0 + block, stop)
        size = b1 - b0
        for j in range(w):
            regs[j] = x[b0 - k + j : b1 - k + j]
        if size != block:
            for r in range(n_scratch):
                regs[w + r] = scratch[r][:size]
        for is_min, a, b, out in steps:
            if is_min:
                np.minimum(regs[a], regs[b], out=regs[out])
            else:
                np.maximum(regs[a], regs[b], out=regs[out])
        s = [regs[r] for r in sorted_reg]
        if shift:  # trailing: the level is the newest half's median, the window gives the scale
            level = _median_of_views([x[b0 - k + j : b1 - k + j] for j in range(w - trailing_level(k), w)])
            mad = _mad_about(s, level, k, dev[:size])
            _flag(x[b0 + shift : b1 + shift], level, mad, scale, min_dev, dev[:size], flags[b0 + shift : b1 + shift])
            continue
        m = s[k]
        # MAD = min over i of max(m - s[k-i], s[2k-i] - m), computed in place in the sorted columns.
        mad = s[2 * k]
        np.subtract(mad, m, out=mad)
        for i in range(1, k):
            left, right = s[k - i], s[2 * k - i]
            np.subtract(m, left, out=left)
            np.subtract(right, m, out=right)
            np.maximum(left, right, out=left)
            np.minimum(mad, left, out=mad)
        np.subtract(m, s[0], out=s[0])
        np.minimum(mad, s[0], out=mad)
        _flag(x[b0 + shift : b1 + shift], m, mad, scale, min_dev, dev[:size], flags[b0 + shift : b1 + shift])


def _median_of_views(views: list[np.ndarray]) -> np.ndarray:
    """Element-wise median of equally long arrays, as ``np.median`` over them (a new array): a
    sorting network over the arrays, then the middle one or the mean of the middle two."""
    w = len(views)
    if w == 1:
        return views[0].copy()
    steps, sorted_reg, n_scratch = _network_program(w)
    regs: list[np.ndarray] = [*views, *(np.empty(views[0].size) for _ in range(n_scratch))]
    for is_min, a, b, out in steps:
        (np.minimum if is_min else np.maximum)(regs[a], regs[b], out=regs[out])
    s = [regs[r] for r in sorted_reg]
    if w % 2:
        return s[w // 2]
    with np.errstate(over="ignore"):  # np.median overflows alike
        return (s[w // 2 - 1] + s[w // 2]) / 2.0


def _mad_about(s: list[np.ndarray], level: np.ndarray, k: int, tmp: np.ndarray) -> np.ndarray:
    """``median |s_j - level|`` over sorted columns ``s`` (``2k+1`` of them): the smallest radius
    around ``level`` that covers ``k+1`` consecutive sorted values. ``s`` is overwritten."""
    mad = None
    for a in range(k + 1):
        left, right = s[a], s[a + k] if a else tmp
        if not a:
            np.subtract(s[k], level, out=right)
        else:
            np.subtract(right, level, out=right)
        np.subtract(level, left, out=left)
        np.maximum(left, right, out=left)
        if mad is None:
            mad = left
        else:
            np.minimum(mad, left, out=mad)
    return mad


def _flag(
    center: np.ndarray,
    m: np.ndarray,
    mad: np.ndarray,
    scale: float,
    min_dev: float,
    dev: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out = |center - m| > max(scale * mad, min_dev)``; ``mad`` is overwritten."""
    np.subtract(center, m, out=dev)
    np.abs(dev, out=dev)
    np.multiply(mad, scale, out=mad)
    if min_dev > 0.0:  # the threshold is >= 0 already, so max(thr, 0) is a no-op
        np.maximum(mad, min_dev, out=mad)
    np.greater(dev, mad, out=out)


# --- interior: row-wise sort for wide windows -------------------------------------------------


def _interior_sorted(x: np.ndarray, k: int, scale: float, min_dev: float, flags: np.ndarray, shift: int) -> None:
    w = 2 * k + 1
    windows = sliding_window_view(x, w)  # row r is the window centred on r + k
    rows = max(1, _SORT_CHUNK_ELEMENTS // w)
    for r0 in range(0, windows.shape[0], rows):
        r1 = min(r0 + rows, windows.shape[0])
        s = np.sort(windows[r0:r1], axis=1)
        if shift:  # trailing: the level is the newest half's median
            m = np.median(windows[r0:r1, w - trailing_level(k) :], axis=1)
            left = m[:, None] - s[:, : k + 1]  # column a: m - s[a]
            right = s[:, k:] - m[:, None]  # column a: s[a+k] - m
        else:
            m = s[:, k].copy()
            left = m[:, None] - s[:, k::-1]  # column i: m - s[k-i]
            right = s[:, 2 * k : k - 1 : -1] - m[:, None]  # column i: s[2k-i] - m
        mad = np.maximum(left, right).min(axis=1)
        dev = np.empty_like(m)
        c0, c1 = r0 + k + shift, r1 + k + shift
        _flag(x[c0:c1], m, mad, scale, min_dev, dev, flags[c0:c1])


# --- edges: shrunken windows, possibly of even length -----------------------------------------


def _edges(
    x: np.ndarray, idx: np.ndarray, first: np.ndarray, last: np.ndarray, scale: float, min_dev: float, flags: np.ndarray,
    level_first: np.ndarray | None = None,
) -> None:
    """Flags of the points ``idx``, each judged on its window ``first .. last`` (inclusive), about
    the window's median or, with ``level_first``, the median of ``level_first .. last``."""
    n = x.size
    if not idx.size:
        return
    width = int(min(n, (last - first).max() + 1))
    rows = max(1, _SORT_CHUNK_ELEMENTS // width)
    offsets = np.arange(width)
    for c0 in range(0, idx.size, rows):
        i = idx[c0 : c0 + rows]
        lo, hi = first[c0 : c0 + rows], last[c0 : c0 + rows]
        count = hi - lo + 1
        cols = lo[:, None] + offsets
        valid = cols <= hi[:, None]
        vals = np.where(valid, x[np.minimum(cols, n - 1)], np.nan)
        if level_first is None:
            m = _padded_median(vals, count)
        else:  # the median of the window's part from level_first on (its newest points)
            newest = np.where(cols >= level_first[c0 : c0 + rows][:, None], vals, np.nan)
            m = _padded_median(np.sort(newest, axis=1), hi - level_first[c0 : c0 + rows] + 1)
        mad = _padded_median(np.abs(vals - m[:, None]), count)
        out = np.empty(i.size, dtype=bool)
        _flag(x[i], m, mad, scale, min_dev, np.empty(i.size), out)
        flags[i] = out


def _padded_median(vals: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Row medians of NaN-padded rows holding ``count`` real values, as ``np.median`` computes them.

    np.median takes the mean of the middle element(s): ``(a + b) / 2`` for even counts.
    """
    s = np.sort(vals, axis=1)  # NaN padding sorts last
    rows = np.arange(s.shape[0])
    lo = s[rows, (count - 1) // 2]
    hi = s[rows, count // 2]
    with np.errstate(over="ignore"):  # odd rows don't use the sum; even rows overflow like np.median
        return np.where(count % 2 == 1, lo, (lo + hi) / 2.0)
