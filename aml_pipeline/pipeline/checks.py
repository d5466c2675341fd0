"""Checks on a written snapshot; blocking ones decide whether it may become ``current``.

Each check recomputes what it checks from the bytes on disk (or from the stored run windows),
independently of the code that wrote them. The Dagster layer reports them as asset checks.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.core.manifest import SPLITS
from aml_pipeline.core.windows import window_block
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec

# Allowed disagreement between fitted and recomputed statistics, as a fraction of the std.
NORM_RTOL = 1e-6


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


def check_norm_from_train(
    spec: DatasetSpec, manifest: dict[str, Any], store: DatasetStore
) -> CheckOutcome:
    """Recompute mean/std from explicitly materialised train windows and compare.

    Independent of the fitting code: windows are gathered explicitly (each window's own rows,
    as the snapshot has them) rather than weighted by row, and the moments are two-pass within
    each block of windows (mean, then centred squares), blocks merged by Chan et al.'s formula.
    Agreement is judged relative to the std, so a leak of validation data into the statistics
    of a 300 K +- 0.01 K signal is still caught.
    """
    cols = {n: j for j, n in enumerate(spec.node_ids)}
    ctrl = [cols[n] for n in spec.control_ids]
    tgt = [cols[n] for n in spec.target_ids]
    train = manifest["split"]["trainRunIds"]
    H, F = spec.history_steps, spec.horizon_steps
    widths = {"x": len(spec.node_ids), "u": len(ctrl), "y": len(tgt)}
    moments = {k: _Moments(w) for k, w in widths.items()}
    # Windows per block: a few MB of float64 per block, whatever a run's length.
    step = max(1, _NORM_BLOCK_VALUES // max(1, H * widths["x"]))
    for run_id in train:
        a = store.read_arrays(run_id, "windows")
        grid, starts = np.ascontiguousarray(a["grid"]), a["starts"]
        if starts.size and (int(starts.min()) < H or int(starts.max()) > grid.shape[0] - F):
            raise ValueError(f"run {run_id}: a stored window start lies outside its grid")
        parts = (("x", grid, -H, 0), ("u", grid[:, ctrl], 0, F), ("y", grid[:, tgt], 0, F))
        for i in range(0, starts.shape[0], step):
            chunk = starts[i : i + step]
            for k, values, lo, hi in parts:
                w = window_block(values, chunk, lo, hi)  # the windows themselves, [n, steps, cols]
                moments[k].add(w.reshape(w.shape[0] * w.shape[1], w.shape[2]))
    worst = 0.0
    problems = []
    for k in "xuy":
        stored = manifest["norm"][k]
        if not stored["mean"]:
            continue
        mean, std = moments[k].mean_std()
        std = np.where(std == 0, 1.0, std)
        smean, sstd = np.asarray(stored["mean"]), np.asarray(stored["std"])
        err = np.maximum(np.abs(mean - smean), np.abs(std - sstd)) / sstd
        worst = max(worst, float(err.max(initial=0.0)))
        if not (err <= NORM_RTOL).all():
            problems.append(k)
    meta = {"worst_relative_error": worst, "train_runs": len(train)}
    if problems:
        return CheckOutcome(
            "norm_stats_from_train_only",
            False,
            f"stored normalisation of {', '.join(problems)} does not match the train windows "
            f"(worst error {worst:.2e} of a std)",
            meta,
        )
    return CheckOutcome(
        "norm_stats_from_train_only",
        True,
        f"mean/std recomputed from the windows of {len(train)} train runs match (worst error {worst:.2e} of a std)",
        meta,
    )


_NORM_BLOCK_VALUES = 1 << 19  # 4 MB of float64 per block: few calls, bounded memory


class _Moments:
    """Count, mean and sum of squared deviations per column: two-pass per block, Chan merge."""

    def __init__(self, n_cols: int) -> None:
        self.n = 0
        self.mean = np.zeros(n_cols)
        self.m2 = np.zeros(n_cols)

    def add(self, rows: np.ndarray) -> None:
        n_b = rows.shape[0]
        if n_b == 0 or rows.shape[1] == 0:
            return
        mean_b = _column_sums(rows) / n_b
        d = np.subtract(rows, mean_b, out=rows)  # the block is ours (a fresh gather)
        np.multiply(d, d, out=d)
        m2_b = _column_sums(d)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (self.n * n_b / n)
        self.n = n

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        n = max(self.n, 1)
        return self.mean, np.sqrt(self.m2 / n)


def _column_sums(rows: np.ndarray) -> np.ndarray:
    """``rows.sum(axis=0)`` of a C-ordered ``[n, cols]`` block, several times faster for few
    columns: rows are summed ``k`` at a time as ``[n / k, k * cols]``, then the ``k`` partial sums."""
    n, c = rows.shape
    k = max(1, 1024 // c)
    m = n - n % k
    out = rows[:m].reshape(m // k, k * c).sum(axis=0).reshape(k, c).sum(axis=0)
    if m < n:
        out += rows[m:].sum(axis=0)
    return out


def check_finite_arrays(snapshot: Path, manifest: dict[str, Any]) -> CheckOutcome:
    """No NaN or inf in any array, read back from disk in chunks (bounded memory)."""
    arrays = dict(manifest.get("artifacts") or {"x": "arrays/x.f32", "u": "arrays/u.f32", "y": "arrays/y.f32"})
    arrays.pop("sidecar", None)
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


def snapshot_checks(
    spec: DatasetSpec, snapshot: Path, sha256: str, store: DatasetStore, files: dict[str, str] | None = None
) -> list[CheckOutcome]:
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    # The hash re-reads every byte and is sequential by nature (sha256 releases the GIL): it
    # runs beside the other checks, which read the bytes (and the train windows) themselves.
    with ThreadPoolExecutor(1, thread_name_prefix="check-hash") as pool:
        hashed = pool.submit(check_hash, snapshot, sha256, files)
        others = [
            check_disjoint_splits(manifest),
            check_norm_from_train(spec, manifest, store),
            check_finite_arrays(snapshot, manifest),
        ]
        return [hashed.result(), *others]
