"""Checks on a written snapshot; blocking ones decide whether it may become ``current``.

Each check recomputes what it checks from the bytes on disk (or from the stored run windows),
independently of the code that wrote them. The Dagster layer reports them as asset checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.core.manifest import SPLITS
from aml_pipeline.core.windows import gather_windows
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


def check_hash(snapshot: Path, sha256: str) -> CheckOutcome:
    v = verify_snapshot(snapshot, sha256)
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
    """Recompute mean/std from explicitly materialised train windows (two passes) and compare.

    Independent of the fitting code: windows are gathered explicitly rather than weighted by
    row, and the std is a plain two-pass one. Agreement is judged relative to the std, so a
    leak of validation data into the statistics of a 300 K +- 0.01 K signal is still caught.
    """
    cols = {n: j for j, n in enumerate(spec.node_ids)}
    ctrl = [cols[n] for n in spec.control_ids]
    tgt = [cols[n] for n in spec.target_ids]
    train = manifest["split"]["trainRunIds"]

    def flat_windows():
        for run_id in train:
            a = store.read_arrays(run_id, "windows")
            x, u, y = gather_windows(a["grid"], a["starts"], spec.history_steps, spec.horizon_steps, ctrl, tgt)
            yield {k: w.reshape(w.shape[0] * w.shape[1], w.shape[2]) for k, w in (("x", x), ("u", u), ("y", y))}

    n = {k: 0 for k in "xuy"}
    s1: dict[str, Any] = {k: 0.0 for k in "xuy"}
    for w in flat_windows():
        for k in "xuy":
            n[k] += w[k].shape[0]
            s1[k] = s1[k] + w[k].sum(axis=0)
    mean = {k: s1[k] / max(n[k], 1) for k in "xuy"}
    s2: dict[str, Any] = {k: 0.0 for k in "xuy"}
    for w in flat_windows():
        for k in "xuy":
            s2[k] = s2[k] + ((w[k] - mean[k]) ** 2).sum(axis=0)
    worst = 0.0
    problems = []
    for k in "xuy":
        stored = manifest["norm"][k]
        if not stored["mean"]:
            continue
        std = np.sqrt(s2[k] / max(n[k], 1))
        std = np.where(std == 0, 1.0, std)
        smean, sstd = np.asarray(stored["mean"]), np.asarray(stored["std"])
        err = np.maximum(np.abs(mean[k] - smean), np.abs(std - sstd)) / sstd
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


def check_finite_arrays(snapshot: Path, manifest: dict[str, Any]) -> CheckOutcome:
    """No NaN or inf in any array, read back from disk in chunks (bounded memory)."""
    arrays = dict(manifest.get("artifacts") or {"x": "arrays/x.f32", "u": "arrays/u.f32", "y": "arrays/y.f32"})
    arrays.pop("sidecar", None)
    bad: dict[str, int] = {}
    total = 0
    for key, rel in arrays.items():
        dtype = np.dtype("<f8") if rel.endswith(".f64") else np.dtype("<f4")
        path = snapshot / rel
        count = path.stat().st_size // dtype.itemsize
        if count == 0:
            continue
        mm = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        step = 1 << 24
        nonfinite = 0
        for i in range(0, count, step):
            nonfinite += int(count_nonfinite(mm[i : i + step]))
        del mm
        total += count
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


def count_nonfinite(a: np.ndarray) -> int:
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def snapshot_checks(
    spec: DatasetSpec, snapshot: Path, sha256: str, store: DatasetStore
) -> list[CheckOutcome]:
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    return [
        check_hash(snapshot, sha256),
        check_disjoint_splits(manifest),
        check_norm_from_train(spec, manifest, store),
        check_finite_arrays(snapshot, manifest),
    ]
