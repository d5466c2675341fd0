"""Exact Hampel (k = 5) on one core: ours against vectorised numpy and numba, same points.

Inputs are what the pipeline hands to Hampel: every measured node (targets, features) of every
run of the workload, after the rules that precede Hampel (non-finite, state, range, duplicates),
one series per (run, node), as ``SeriesCleaner`` calls it. Every implementation gets exactly
these series, one call per series (the pipeline's use), in the same alternating repetitions
(``bench.timing.side_by_side``), and its flags are compared with ours element for element.

* ours: ``aml_pipeline.core.hampel.hampel_outliers``;
* numpy: :func:`hampel_numpy`, what one writes with numpy: ``sliding_window_view`` over the
  series, ``np.median`` of every full window and of its absolute deviations, and
  ``np.nanmedian`` over NaN-padded windows for the ``2k`` points at the ends, whose windows
  shrink (numpy's even-count median, as the contract says);
* numba (when installed, ``scripts/bench.sh`` installs it): :func:`hampel_numba`, a compiled
  loop keeping the window sorted incrementally (one removal and one insertion per point, O(k))
  and reading the MAD off the sorted window by merging the deviations on both sides of the
  median (O(k)); compiled before timing.

The pure-Python loop ``aml_pipeline_tests.reference.hampel_reference`` is the correctness oracle
on adversarial series (quantised values with ties and MAD 0, spikes, every short length where
the window shrinks at both ends, ``min_dev`` on and off); it is far too slow to be a speed
reference. sktime's ``HampelFilter`` is not compared: see bench/README.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from bench.timing import Sample, side_by_side

K, SIGMA, MIN_DEV = 5, 3.0, 0.0
MAD_SCALE = 1.4826
_ROWS_PER_CHUNK = 1 << 16  # bounds the numpy reference's temporaries for long series


def hampel_inputs(tsdb_url: str, spec_dict: dict[str, Any], max_runs: int | None = None) -> list[np.ndarray]:
    """The Hampel input series of every (run, measured node) of the workload."""
    from aml_pipeline.pipeline.plan import run_scope
    from aml_pipeline.pipeline.stages.grid import node_grid_params
    from aml_pipeline.pipeline.stages.raw import run_bounds
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline_tests.core.whole_series import clean_series
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    spec = parse_spec(spec_dict)
    series = []
    with open_tsdb(tsdb_url) as db:
        catalog = {n.node_id: n for n in db.list_nodes()}
        runs = db.list_runs(run_scope(spec), finished_only=True)[:max_runs]
        for run in runs:
            lo, hi = run_bounds(spec, run)
            for node in spec.nodes:
                c = catalog[node.node_id]
                params = node_grid_params(spec, node, (c.range_lo, c.range_hi))
                if params.hampel_k == 0:
                    continue  # setpoints logged on change: Hampel is off for them
                s = fetch_node_series(db, node.node_id, run.run_id, lo, hi)
                # Every rule before Hampel: what the cleaner hands the filter.
                kept = clean_series(s.ts, s.value, s.state, dataclasses.replace(params, hampel_k=0))
                series.append(np.ascontiguousarray(kept.value))
    return series


# ---- the numpy reference -----------------------------------------------------------------------


def hampel_numpy(x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0) -> np.ndarray:
    """Hampel flags with numpy's own medians over ``sliding_window_view`` (see the module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    flags = np.zeros(n, dtype=bool)
    if k == 0 or n == 0:
        return flags
    w = 2 * k + 1
    if n >= w:
        windows = sliding_window_view(x, w)  # row r: the full window centred on r + k
        for r0 in range(0, windows.shape[0], _ROWS_PER_CHUNK):
            win = windows[r0 : r0 + _ROWS_PER_CHUNK]
            m = np.median(win, axis=1)
            mad = np.median(np.abs(win - m[:, None]), axis=1)
            centre = x[r0 + k : r0 + k + win.shape[0]]
            flags[r0 + k : r0 + k + win.shape[0]] = np.abs(centre - m) > np.maximum(sigma * MAD_SCALE * mad, min_dev)
    # The ends: windows max(0, i-k)..min(n-1, i+k) are the full windows of the NaN-padded series
    # with the NaNs left out, which is what nanmedian does.
    edge = np.arange(n) if n <= 2 * k else np.concatenate([np.arange(k), np.arange(n - k, n)])
    padded = np.concatenate([np.full(k, np.nan), x, np.full(k, np.nan)])
    win = sliding_window_view(padded, w)[edge]
    m = np.nanmedian(win, axis=1)
    mad = np.nanmedian(np.abs(win - m[:, None]), axis=1)
    flags[edge] = np.abs(x[edge] - m) > np.maximum(sigma * MAD_SCALE * mad, min_dev)
    return flags


# ---- the numba reference -----------------------------------------------------------------------

_numba_kernel = None


def numba_unavailable() -> str | None:
    """Why the numba reference cannot run here, or None."""
    try:
        import numba  # noqa: F401
    except Exception as e:  # noqa: BLE001 - optional, benchmark-only
        return f"numba not importable ({type(e).__name__}: {e}); scripts/bench.sh installs it"
    return None


def _compile_numba():
    global _numba_kernel
    if _numba_kernel is not None:
        return _numba_kernel
    import numba

    @numba.njit(cache=False, nogil=True)
    def kernel(x, k, scale, min_dev, flags):  # pragma: no cover - compiled
        n = x.shape[0]
        s = np.empty(2 * k + 1)  # the current window, sorted
        c = 0
        hi = -1  # last index in the window
        for i in range(n):
            # window of i: max(0, i-k)..min(n-1, i+k): drop x[i-k-1], add x[i+k]
            out = i - k - 1
            if out >= 0:
                v = x[out]
                a, b = 0, c - 1
                while a < b:  # leftmost position holding v
                    mid = (a + b) // 2
                    if s[mid] < v:
                        a = mid + 1
                    else:
                        b = mid
                for j in range(a, c - 1):
                    s[j] = s[j + 1]
                c -= 1
            while hi < min(n - 1, i + k):
                hi += 1
                v = x[hi]
                j = c
                while j > 0 and s[j - 1] > v:
                    s[j] = s[j - 1]
                    j -= 1
                s[j] = v
                c += 1
            lower = (c - 1) // 2
            if c % 2 == 1:
                m = s[lower]
            else:
                m = (s[lower] + s[lower + 1]) / 2.0
            # deviations grow outward from the median on both sides: merge them in order and
            # keep the middle one(s)
            a, b = lower, lower + 1
            want = c // 2
            prev = 0.0
            cur = 0.0
            for _ in range(want + 1):
                if b >= c or (a >= 0 and m - s[a] <= s[b] - m):
                    d = m - s[a]
                    a -= 1
                else:
                    d = s[b] - m
                    b += 1
                prev = cur
                cur = d
            mad = cur if c % 2 == 1 else (prev + cur) / 2.0
            thr = scale * mad
            if thr < min_dev:
                thr = min_dev
            flags[i] = abs(x[i] - m) > thr

    _numba_kernel = kernel
    kernel(np.arange(40, dtype=np.float64), 5, 3.0 * MAD_SCALE, 0.0, np.zeros(40, dtype=np.bool_))  # compile
    return kernel


def hampel_numba(x: np.ndarray, k: int, sigma: float, min_dev: float = 0.0) -> np.ndarray:
    """Hampel flags from the compiled sorted-window loop (see the module docstring)."""
    kernel = _compile_numba()
    x = np.ascontiguousarray(x, dtype=np.float64)
    flags = np.zeros(x.size, dtype=bool)
    if k > 0 and x.size:
        # sigma * 1.4826 first, as Python evaluates sigma * 1.4826 * mad
        kernel(x, int(k), float(sigma) * MAD_SCALE, float(min_dev), flags)
    return flags


# ---- the benchmark -----------------------------------------------------------------------------


def adversarial_series() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    out = [np.round(np.cumsum(rng.normal(size=20_000)) * 2) / 2]  # quantised: ties and MAD = 0 plateaus
    spiky = rng.normal(size=5_000)
    spiky[rng.random(spiky.size) < 0.05] += 15
    out.append(spiky)
    out.extend(rng.integers(0, 3, size=n).astype(np.float64) for n in range(1, 4 * K + 3))  # shrinking ends
    return out


def _mismatches(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    return sum(int(np.count_nonzero(x != y)) for x, y in zip(a, b, strict=True))


def run(tsdb_url: str, spec_dict: dict[str, Any], *, repeat: int) -> dict[str, Any]:
    from aml_pipeline.core.hampel import hampel_outliers
    from aml_pipeline_tests.reference import hampel_reference

    series = hampel_inputs(tsdb_url, spec_dict)
    points = int(sum(s.size for s in series))
    impls = {"ours": hampel_outliers, "numpy_vectorised": hampel_numpy}
    why_no_numba = numba_unavailable()
    if why_no_numba is None:
        _compile_numba()  # compiled before the clock, once
        impls["numba"] = hampel_numba

    def side(fn):
        def call() -> Sample:
            c0, t0 = time.process_time(), time.perf_counter()
            flags = [fn(s, K, SIGMA, MIN_DEV) for s in series]
            return Sample(time.perf_counter() - t0, flags, {"cpu_seconds": time.process_time() - c0})

        return call

    cmp = side_by_side({name: side(fn) for name, fn in impls.items()}, repeat=repeat)
    ours_flags = cmp.values["ours"]
    mismatches = {name: _mismatches(ours_flags, cmp.values[name]) for name in impls if name != "ours"}

    # the long-series figure: all series end to end in one call (fixed costs amortised)
    long = np.concatenate(series) if series else np.empty(0)
    long_cmp = side_by_side({"ours": lambda: hampel_outliers(long, K, SIGMA, MIN_DEV)}, repeat=repeat)

    # adversarial cases: every implementation against the pure-Python oracle
    adversarial = {name: 0 for name in impls}
    adversarial_points = 0
    for s in adversarial_series():
        for min_dev in (0.0, 0.25):
            oracle = hampel_reference(s, K, SIGMA, min_dev)
            adversarial_points += s.size
            for name, fn in impls.items():
                adversarial[name] += int(np.count_nonzero(fn(s, K, SIGMA, min_dev) != oracle))

    ours_t = cmp.timing("ours")
    out: dict[str, Any] = {
        "k": K, "sigma": SIGMA, "min_dev": MIN_DEV, "series": len(series), "points": points,
        "timings": cmp.to_json(),
        "mpts_per_s": {
            name: _rate(points, cmp.timing(name)) for name in impls
        },
        "cpu_over_wall_ours": cmp.metric("ours", "cpu_seconds")["median"] / ours_t["median"],
        "mpts_per_s_long_series": _rate(long.size, long_cmp.timing("ours")),
        "over_numpy_vectorised": cmp.ratio("numpy_vectorised", "ours"),
        "over_numba": cmp.ratio("numba", "ours") if "numba" in impls else None,
        "numba": {"available": why_no_numba is None, "reason": why_no_numba},
        "flagged": int(sum(int(f.sum()) for f in ours_flags)),
        "flag_mismatches": mismatches,
        "adversarial_points": adversarial_points,
        "adversarial_mismatches": adversarial,
        "flags_identical": all(v == 0 for v in mismatches.values()) and all(v == 0 for v in adversarial.values()),
    }
    return out


def _rate(points: int, t: dict[str, Any]) -> dict[str, Any]:
    """Throughput in M points/s: from the median time, and the range over repetitions."""
    return {"value": points / t["median"] / 1e6, "min": points / t["max"] / 1e6,
            "max": points / t["min"] / 1e6, "repeat": t["repeat"]}
