"""Checks on a written snapshot; blocking ones decide whether it may become ``current``.

Each check recomputes what it checks from the snapshot's bytes on disk, independently of the code
that wrote them, so the same checks run at publication and later on any published snapshot. The
Dagster layer reports them as asset checks. Both layouts are checked for the same thing: the
series layout's windows are read through its window index (each stored row weighted by the
number of windows that read it), in bounded memory.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.pipeline.publish import Catalog, CatalogEntry
from aml_pipeline.snapshot.layout import (
    ARRAYS,
    MANIFEST_FILE,
    SEGMENT_FIELDS,
    SERIES_ARRAYS,
    SERIES_LAYOUT,
    SERIES_ROWS,
    SPLITS,
    V1_ARRAYS,
    SnapshotError,
    manifest_layout,
)
from aml_pipeline.snapshot.series import SeriesIndex

# The blocking checks, by name, in the order they are reported.
MANIFEST_CHECKS = {
    "hash_verifies": "every hashed byte of the published snapshot matches its sha256 (sha256.json and the catalog)",
    "no_run_in_two_splits": "no run appears in two splits; one block per run",
    "norm_stats_from_train_only": "normalised train windows have mean 0 and std 1 (statistics fitted on train windows only)",
    "no_nan_or_inf": "no NaN or inf in any array (series layout: in any stored row, every window's rows stored)",
}

# Allowed deviation of the normalised train windows' mean from 0 and std from 1. float32 rounding
# leaves about 1e-7; statistics that saw other windows move them by a fraction of a std.
NORM_TOL = 1e-5


@dataclass
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
    blocking: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "description": self.description}


def check_hash(snapshot: Path, sha256: str, files: dict[str, str] | None = None) -> CheckOutcome:
    """Re-read and hash every hashed byte; ``files`` (the writer's per-file digests) names what
    changed when the digest file is not written yet."""
    v = verify_snapshot(snapshot, sha256, files)
    if v.ok:
        return CheckOutcome("hash_verifies", True, f"sha256 {sha256} matches every hashed byte")
    return CheckOutcome(
        "hash_verifies",
        False,
        f"hash mismatch ({v.problem}); changed: {', '.join(v.changed)}",
        {"expected": v.expected, "actual": v.actual},
    )


def check_disjoint_splits(manifest: dict[str, Any]) -> CheckOutcome:
    split = manifest["split"]
    seen: dict[str, str] = {}
    twice = []
    for part in SPLITS:
        for run in split[f"{part}RunIds"]:
            if run in seen:
                twice.append(f"{run} ({seen[run]} and {part})")
            seen[run] = part
    block_runs = [b["runId"] for b in split["blocks"]]
    ok = not twice and sorted(block_runs) == sorted(seen)
    desc = (
        f"{len(seen)} runs, each in exactly one split"
        if ok
        else f"runs in two splits: {', '.join(twice) or 'none'}; blocks match runs: {sorted(block_runs) == sorted(seen)}"
    )
    return CheckOutcome("no_run_in_two_splits", ok, desc)


def check_norm_from_train(snapshot: Path, manifest: dict[str, Any], index: Any = None) -> CheckOutcome:
    """The train windows of the snapshot's arrays have mean 0 and std 1 in every column.

    Statistics fitted on the train windows only, and applied as ``(v - mean) / std``, leave the
    normalised train windows with exactly mean 0 and std 1 per column (std 0 for a constant
    column), up to float32 rounding (about 1e-7). Statistics that saw validation or test windows,
    arrays normalised with other statistics than the manifest's, or windows missing from train
    move them by far more. Read from the snapshot's bytes alone, so it can be re-run on any
    published snapshot (the ``<spec>__verify`` job), independently of the code that fitted them.
    ``index``: the series layout's window index as :func:`read_series_index` returned it (None:
    read here).
    """
    n_train = int(manifest["split"]["train"])
    problems: list[str] = []
    worst = 0.0
    series = manifest_layout(manifest) == SERIES_LAYOUT
    if index is None:
        index = read_series_index(snapshot, manifest)
    if isinstance(index, Exception):
        return CheckOutcome("norm_stats_from_train_only", False, f"the window index cannot be read: {index}")
    for key in V1_ARRAYS:
        shape = manifest["shapes"][key]
        cols = int(shape[2])
        if cols == 0 or n_train == 0:
            continue
        if index is not None:
            moments = _series_train_moments(snapshot, manifest, index, key, n_train)
        else:
            moments = _windows_train_moments(snapshot / ARRAYS[key][0], n_train, int(shape[1]), cols)
        if moments is None:
            rel = SERIES_ARRAYS[SERIES_ROWS[key]][0] if series else ARRAYS[key][0]
            return CheckOutcome("norm_stats_from_train_only", False, f"{rel} is shorter than its manifest shape")
        mean, std = moments.mean_std()
        zero = set(manifest["norm"][key].get("zeroStd") or [])
        names = {"x": manifest["allNodes"], "u": manifest["controls"], "y": manifest["targets"]}[key]
        want_std = np.array([0.0 if n in zero else 1.0 for n in names])
        err = np.maximum(np.abs(mean), np.abs(std - want_std))
        worst = max(worst, float(err.max(initial=0.0)))
        bad = [names[c] for c in np.flatnonzero(err > NORM_TOL)]
        if bad:
            problems.append(f"{key}: {', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else ""))
    meta = {"worst_deviation": worst, "tolerance": NORM_TOL, "train_windows": n_train}
    if problems:
        return CheckOutcome(
            "norm_stats_from_train_only",
            False,
            "normalised train windows are not mean 0 / std 1 (statistics not fitted on exactly the "
            f"train windows, or not the ones applied): {'; '.join(problems)} (worst deviation {worst:.2e})",
            meta,
        )
    return CheckOutcome(
        "norm_stats_from_train_only",
        True,
        f"{n_train} normalised train windows have mean 0 and std 1 in every column (worst deviation {worst:.2e})",
        meta,
    )


def _windows_train_moments(path: Path, n_train: int, steps: int, cols: int) -> _Moments | None:
    """Moments of the first ``n_train`` windows of a windows-layout array (None: file too short)."""
    moments = _Moments(cols)
    values = n_train * steps * cols
    step = max(cols, (_NORM_BLOCK_VALUES // cols) * cols)
    buf = np.empty(min(step, values), dtype="<f4")  # one buffer, read into: no allocation per block
    with open(path, "rb", buffering=0) as f:
        for start in range(0, values, step):
            count = min(step, values - start)
            block = buf[:count]
            if _read_full(f, block) != block.nbytes:
                return None
            moments.add(block.reshape(-1, cols))
    return moments


def read_series_index(snapshot: Path, manifest: dict[str, Any]) -> SeriesIndex | Exception | None:
    """The series layout's checked window index, the error that made it unreadable, or None
    (windows layout): read once for the checks that use it."""
    if manifest_layout(manifest) != SERIES_LAYOUT:
        return None
    try:
        return _series_index(snapshot, manifest)
    except (SnapshotError, OSError, ValueError, KeyError, TypeError) as e:
        return e


def _series_index(snapshot: Path, manifest: dict[str, Any]) -> SeriesIndex:
    """The series layout's window index (a read-only map of it), checked against the manifest."""
    shapes = manifest["shapes"]
    K = int(shapes["segments"][1])
    path = snapshot / SERIES_ARRAYS["segments"][0]
    if path.stat().st_size != len(SEGMENT_FIELDS) * K * 8:
        raise SnapshotError(f"{path.name} has {path.stat().st_size} bytes, manifest shape {shapes['segments']}")
    segments = (np.memmap(path, dtype="<i8", mode="r", shape=(len(SEGMENT_FIELDS), K)) if K
                else np.zeros((len(SEGMENT_FIELDS), 0), dtype=np.int64))
    n = sum(int(manifest["split"][p]) for p in SPLITS)
    index = SeriesIndex(segments, windows=n, history=int(manifest["historySteps"]),
                        horizon=int(manifest["horizonSteps"]), stride=int(manifest["series"]["stride"]),
                        beat_ms=int(manifest["beatMs"]))
    index.validate(snapshot, run_windows=[int(b["uniqueSteps"]) for b in manifest["split"]["blocks"]],
                   x_rows=int(shapes["xRows"][0]), future_rows=int(shapes["uRows"][0]))
    return index


# Window offsets computed per slice of windows in the series check (int64 each).
_SERIES_WINDOWS = 1 << 16


def _series_train_moments(snapshot: Path, manifest: dict[str, Any], index: SeriesIndex, key: str,
                          n_train: int) -> _Moments | None:
    """Moments of the values the first ``n_train`` windows of ``key`` read, from the stored rows:
    each row weighted by the number of those windows that read it (None: rows file too short).

    Windows are taken a slice at a time; the rows a stretch of them reads (contiguous: their
    first rows ascend) are read from the file into a buffer of at most about 4 MB of values.
    """
    rows_key = SERIES_ROWS[key]
    rel = SERIES_ARRAYS[rows_key][0]
    total_rows, cols = (int(v) for v in manifest["shapes"][rows_key])
    steps = int(manifest["shapes"][key][1])
    group = "x" if key == "x" else "future"
    budget = max(steps + 1, _NORM_BLOCK_VALUES // cols)  # rows per read
    moments = _Moments(cols)
    with open(snapshot / rel, "rb", buffering=0) as f:
        for w0 in range(0, n_train, _SERIES_WINDOWS):
            first = index.rows(group, np.arange(w0, min(n_train, w0 + _SERIES_WINDOWS), dtype=np.int64))
            i = 0
            while i < first.size:
                # The longest stretch of windows from i whose rows fit the buffer (at least one).
                j = max(i + 1, int(np.searchsorted(first, first[i] + budget - steps, side="right")))
                lo, hi = int(first[i]), int(first[j - 1]) + steps
                if hi > total_rows:
                    return None
                rows = np.empty((hi - lo, cols), dtype="<f4")
                f.seek(lo * cols * 4)
                if _read_full(f, rows) != rows.nbytes:
                    return None
                # Windows per row: +1 where a window's rows begin, -1 one past their end.
                starts = first[i:j] - lo
                weights = np.cumsum(np.bincount(starts, minlength=hi - lo + 1)[: hi - lo]
                                    - np.bincount(starts + steps, minlength=hi - lo + 1)[: hi - lo])
                moments.add_weighted(rows, weights)
                i = j
    return moments


def _read_full(f: Any, out: np.ndarray) -> int:
    """Read into ``out`` until it is full or the file ends; the bytes read."""
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    return got


_NORM_BLOCK_VALUES = 1 << 19  # 4 MB of float64 per block: few calls, bounded memory


class _Moments:
    """Count, mean and sum of squared deviations per column, merged block by block (Chan et al.).

    A block's sums and sums of squares are accumulated in float64 straight from its float32
    values (no float64 copy of the block): normalised values are of order 1, so the block's
    ``sum(v^2) - sum(v)^2 / n`` loses nothing the check's tolerance could see (the float64
    rounding is below 1e-12 of a column's variance for means up to 1e3 standard deviations).
    """

    def __init__(self, n_cols: int) -> None:
        self.n = 0
        self.mean = np.zeros(n_cols)
        self.m2 = np.zeros(n_cols)

    def add(self, rows: np.ndarray) -> None:
        n_b, cols = rows.shape
        if n_b == 0 or cols == 0:
            return
        sums, squares = _column_sums_and_squares(rows)
        self._merge(n_b, sums, squares)

    def add_weighted(self, rows: np.ndarray, weights: np.ndarray) -> None:
        """Add ``rows`` (float32 ``[n, cols]``), row ``r`` counted ``weights[r]`` times."""
        n_b = float(weights.sum())
        if n_b == 0 or rows.shape[1] == 0:
            return
        w = weights.astype(np.float64)
        values = rows.astype(np.float64)
        # einsum, not a BLAS product: BLAS threads that wait for a busy core cost more than the
        # product itself on a shared machine.
        sums = np.einsum("i,ij->j", w, values)
        squares = np.einsum("i,ij->j", w, np.multiply(values, values, out=values))  # squared in place
        self._merge(n_b, sums, squares)

    def _merge(self, n_b: float, sums: np.ndarray, squares: np.ndarray) -> None:
        mean_b = sums / n_b
        m2_b = np.maximum(squares - sums * mean_b, 0.0)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (self.n * n_b / n)
        self.n = n

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        n = max(self.n, 1)
        return self.mean, np.sqrt(self.m2 / n)


def _column_sums_and_squares(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of a C-ordered ``[n, cols]`` block: the sum and the sum of squares, in float64.

    Rows are taken ``k`` at a time as ``[n / k, k * cols]`` (long rows reduce several times
    faster than few columns), then the ``k`` partial results are folded.
    """
    n, c = rows.shape
    k = max(1, 1024 // c)
    m = n - n % k
    wide = rows[:m].reshape(m // k, k * c)
    sums = np.add.reduce(wide, axis=0, dtype=np.float64).reshape(k, c).sum(axis=0)
    squares = np.einsum("ij,ij->j", wide, wide, dtype=np.float64).reshape(k, c).sum(axis=0)
    if m < n:
        rest = rows[m:].astype(np.float64)
        sums += rest.sum(axis=0)
        squares += (rest * rest).sum(axis=0)
    return sums, squares


def check_finite_arrays(snapshot: Path, manifest: dict[str, Any], index: Any = None) -> CheckOutcome:
    """No NaN or inf in any array, read back from disk in chunks (bounded memory).

    In the series layout the arrays are the stored rows, each read by some window, and the
    window index must place every window's rows inside them (its timestamps and mask are
    derived, finite by construction). ``index``: as for :func:`check_norm_from_train`."""
    arrays = dict(manifest.get("artifacts") or {k: ARRAYS[k][0] for k in V1_ARRAYS})
    arrays.pop("sidecar", None)
    if manifest_layout(manifest) == SERIES_LAYOUT:
        arrays.pop("segments", None)
        if index is None:
            index = read_series_index(snapshot, manifest)
        if isinstance(index, Exception):
            return CheckOutcome("no_nan_or_inf", False, f"the window index does not place every window's rows: {index}")
    bad: dict[str, int] = {}
    total = 0
    buf = bytearray(_FINITE_CHUNK)
    for key, rel in arrays.items():
        dtype = np.dtype("<f8") if rel.endswith(".f64") else np.dtype("<f4")
        nonfinite = 0
        tail = 0  # bytes of an incomplete value carried over between reads
        with open(snapshot / rel, "rb", buffering=0) as f:
            while n := f.readinto(memoryview(buf)[tail:]):
                n += tail
                usable = n - n % dtype.itemsize
                values = np.frombuffer(buf, dtype=dtype, count=usable // dtype.itemsize)
                nonfinite += count_nonfinite(values)
                total += values.size
                del values
                tail = n - usable
                buf[:tail] = buf[usable:n]
        if nonfinite:
            bad[key] = nonfinite
    if bad:
        return CheckOutcome(
            "no_nan_or_inf",
            False,
            "non-finite values: " + ", ".join(f"{k}: {v}" for k, v in bad.items()),
            {"non_finite": bad},
        )
    return CheckOutcome("no_nan_or_inf", True, f"{total} values, all finite", {"values": total})


_FINITE_CHUNK = 8 << 20


def count_nonfinite(a: np.ndarray) -> int:
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def snapshot_checks(snapshot: Path, sha256: str, files: dict[str, str] | None = None) -> list[CheckOutcome]:
    """The four blocking checks, from the snapshot's own bytes (and its recorded hash)."""
    manifest = json.loads((snapshot / MANIFEST_FILE).read_bytes())
    # The hash re-reads every byte and is sequential by nature (sha256 releases the GIL): it
    # runs beside the other checks, which read the bytes (and the train windows) themselves.
    with ThreadPoolExecutor(1, thread_name_prefix="check-hash") as pool:
        hashed = pool.submit(check_hash, snapshot, sha256, files)
        index = read_series_index(snapshot, manifest)  # read and checked once, for both checks
        others = [
            check_disjoint_splits(manifest),
            check_norm_from_train(snapshot, manifest, index),
            check_finite_arrays(snapshot, manifest, index),
        ]
        return [hashed.result(), *others]


def check_current(datasets_root: Path, spec_id: str) -> tuple[CatalogEntry | None, list[CheckOutcome]]:
    """The blocking checks on the spec's current snapshot, from its bytes and the catalog's hash;
    each failed with ``NO_SNAPSHOT`` when the spec has none."""
    entry = Catalog(datasets_root).current(spec_id)
    if entry is None:
        why = f"NO_SNAPSHOT: spec {spec_id!r} has no current snapshot under {datasets_root}"
        return None, [CheckOutcome(name, False, why) for name in MANIFEST_CHECKS]
    outcomes = snapshot_checks(Path(entry.path), entry.sha256)
    return entry, [CheckOutcome(o.name, o.passed, f"{entry.path}: {o.description}", o.metadata) for o in outcomes]
