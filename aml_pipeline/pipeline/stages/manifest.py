"""The manifest stage: the snapshot, written, checked and published.

:func:`publish_dataset` writes the snapshot into a staging directory
(:mod:`aml_pipeline.pipeline.snapshot_writer`), runs the blocking checks on the written bytes (read
back from disk while the fsyncs finish), renames the directory into place and only then, if the
checks passed, makes it ``current`` in the catalog (:mod:`aml_pipeline.pipeline.publish`). A rebuild
whose inputs (stage versions, runs, their data versions) equal those of the current snapshot
publishes nothing; array files whose inputs did not change are hard links to the previous
snapshot's.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aml_pipeline.core.hashing import SnapshotDigest
from aml_pipeline.errors import BuildError, DiskFullError, disk_full
from aml_pipeline.faults import crash_point
from aml_pipeline.fsutil import dir_lock
from aml_pipeline.pipeline.checks import CheckOutcome, snapshot_checks
from aml_pipeline.pipeline.metadata import FilePath, Json, Table
from aml_pipeline.pipeline.publish import (
    Catalog,
    CatalogEntry,
    publish_staged,
    set_current,
    staging_dir,
)
from aml_pipeline.pipeline.reports import lineage_rows, lineage_summary, model_units
from aml_pipeline.pipeline.snapshot_writer import array_name, write_snapshot_files
from aml_pipeline.pipeline.stages.base import Stage, inputs_key
from aml_pipeline.pipeline.stages.norm import Normalization
from aml_pipeline.pipeline.stages.split import DatasetPlan
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.snapshot.layout import DIGEST_FILE, SERIES_ARRAYS, SERIES_LAYOUT, SPLITS, manifest_layout
from aml_pipeline.spec import DatasetSpec


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    return {"spec": spec.fingerprint()}  # spec.json is the snapshot's first hashed file


MANIFEST = Stage(
    name="manifest",
    asset="dataset_manifest",
    upstream="norm",
    per_run=False,
    algorithm=2,
    covers=_covers,
    files=(),  # the snapshot itself, under the datasets root (aml_pipeline.snapshot.layout)
    description=(
        "The published snapshot: arrays, manifest, report and hash. Becomes `current` only if the "
        "blocking checks pass; a rebuild with nothing new publishes nothing."
    ),
)


@dataclass
class PublishedDataset:
    snapshot_dir: Path
    sha256: str
    manifest: dict[str, Any]
    report: dict[str, Any]
    checks: list[CheckOutcome]
    current: bool
    published: bool = True  # False: nothing new, ``snapshot_dir`` is the unchanged current snapshot
    linked: list[str] = field(default_factory=list)  # files shared with the previous snapshot

    def summary(self) -> dict[str, Any]:
        """The JSON the CLI prints as its last line."""
        split = self.manifest["split"]
        return {
            "specId": self.manifest["spec"]["id"],
            "snapshotDir": str(self.snapshot_dir),
            "sha256": self.sha256,
            "manifestVersion": self.manifest["version"],
            "layout": manifest_layout(self.manifest),
            "windows": {p: split[p] for p in SPLITS},
            "runs": {
                "train": len(split["trainRunIds"]),
                "val": len(split["valRunIds"]),
                "test": len(split["testRunIds"]),
                "excluded": len(split["excluded"]),
            },
            "lineageVerified": self.manifest.get("lineageVerified", 0),
            "current": self.current,
            "published": self.published,
            "checks": {c.name: c.passed for c in self.checks},
        }

    def figures(self, store: DatasetStore, plan: DatasetPlan) -> dict[str, Any]:
        """Where the snapshot is and its hash, whether it was published, windows and runs per split,
        lineage, the statistics in model units and the lag cross-correlation."""
        summary, m = self.summary(), self.manifest
        units = model_units(store, plan)
        lags = [
            {"control": r["control"], "target": r["target"], "lag_steps": r["lagSteps"] if r["lagSteps"] is not None else -1,
             "lag_ms": r["lagMs"] if r["lagMs"] is not None else -1, "corr": r["corr"] if r["corr"] is not None else float("nan")}
            for r in (self.report.get("lagCrossCorrelation") or [])
        ]
        norm = [
            {"array": g, "node": n, "model_unit": units.get(n, ""), "mean": m["norm"][g]["mean"][i], "std": m["norm"][g]["std"][i]}
            for g, names in (("x", m["allNodes"]), ("u", m["controls"]), ("y", m["targets"]))
            for i, n in enumerate(names)
        ]
        return {
            "snapshot_dir": FilePath(self.snapshot_dir),
            "sha256": self.sha256,
            "published": self.published,
            "manifest_version": m["version"],
            "layout": summary["layout"],
            "current": self.current,
            "lineage_verified": m.get("lineageVerified", 0),
            "lineage": lineage_summary(store, plan),
            "lineage_per_run": Table(lineage_rows(store, plan)),
            **{f"windows_{p}": summary["windows"][p] for p in SPLITS},
            **{f"runs_{p}": summary["runs"][p] for p in (*SPLITS, "excluded")},
            "norm": Table(norm),
            "lag_cross_correlation": Table(lags),
            "shared_with_previous": ", ".join(self.linked) or "-",
            "summary": Json(summary),
        }

    def line(self) -> str:
        if not self.published:
            return f"nothing new since snapshot {self.snapshot_dir} (same spec stages, runs and data): not published"
        return (f"published {self.snapshot_dir} sha256 {self.sha256} current={self.current}"
                + (f"; shared with the previous snapshot: {', '.join(self.linked)}" if self.linked else ""))


def build_key(store: DatasetStore, plan: DatasetPlan, norm: Normalization) -> str:
    """Everything a snapshot's content depends on, except its capture time and the TSDB's global
    watermark: the manifest stage's version (spec and code), the plan (runs, split, data
    versions) and the statistics applied. Equal keys, equal data: nothing new to publish."""
    return inputs_key(store.versions[MANIFEST], plan.key(), norm.to_json(store.spec))


def file_keys(store: DatasetStore, plan: DatasetPlan, norm: Normalization) -> dict[str, str]:
    """What each array file is computed from (equal key, equal bytes): shared by hard link."""
    spec = store.spec
    stats = norm.to_json(spec)
    base = (MANIFEST.algorithm, plan.key())
    if spec.layout == SERIES_LAYOUT:
        # The window index depends on the runs' windows alone, each row file also on its statistics.
        keys = {SERIES_ARRAYS[k][0]: inputs_key(k, *base, stats[g]) for k, g in (("xRows", "x"), ("uRows", "u"), ("yRows", "y"))}
        keys[SERIES_ARRAYS["segments"][0]] = inputs_key("segments", *base, spec.stride)
        return keys
    keys = {array_name(k): inputs_key(k, *base, stats[k]) for k in ("x", "u", "y")}
    if spec.extras is not None:
        keys.update({array_name(k): inputs_key(k, *base) for k in ("timestamps", "mask")})
    return keys


def publish_dataset(
    store: DatasetStore,
    plan: DatasetPlan,
    norm: Normalization,
    datasets_root: Path,
    *,
    availability_watermark: int | None,
    timings: dict[str, float] | None = None,
) -> PublishedDataset:
    """Write, check and publish a snapshot; ``current`` only if the blocking checks pass.

    When the current snapshot was built from exactly these inputs (:func:`build_key`), nothing is
    written and it is returned with ``published=False``. Otherwise the checks read the written
    files back (every byte, independently of the writer) while the disk is still making them
    durable; the directory is renamed into place once the files are fsynced, whatever the checks
    found (a failed snapshot stays for inspection, not current). ``timings``, if given, receives
    the seconds of ``write``, ``checks``, ``durable`` and ``publish``.

    Running out of space is a :class:`DiskFullError` naming the datasets root and about how many
    bytes the snapshot needed; the staging directory is removed and ``current``, the catalog and
    the previous snapshots are untouched.
    """
    spec = store.spec
    key = build_key(store, plan, norm)
    catalog = Catalog(datasets_root)
    current = catalog.current(spec.id)
    if current is not None and current.build_key == key:
        return _unchanged(current)
    clock = _Clock(timings)
    captured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    keys = file_keys(store, plan, norm)
    try:
        with _publishing(Path(datasets_root) / spec.id), staging_dir(datasets_root, spec.id) as staging:
            # Under the lock: gc cannot remove a file between choosing it and linking it.
            linked = _shareable(catalog.current(spec.id), keys)
            files = write_snapshot_files(
                store, plan, norm, staging,
                availability_watermark=availability_watermark, captured_at=captured_at, wait_durable=False,
                linked=linked,
            )
            crash_point("publish.staging_written")
            clock.lap("write")
            try:
                checks = snapshot_checks(staging, files.sha256, files.files)
                clock.lap("checks")
            finally:
                files.wait_durable()
            clock.lap("durable")
            snapshot = publish_staged(staging, SnapshotDigest(files.sha256, files.files, keys))
            passed = all(c.passed for c in checks if c.blocking)
            if passed:
                set_current(snapshot)
                crash_point("publish.current_swapped")
            catalog.record(
                snapshot, files.manifest, files.sha256, current=passed, build_key=key,
                checks={c.name: c.to_json() for c in checks},
            )
            crash_point("publish.catalog_recorded")
    except OSError as e:
        full = disk_full(e, Path(datasets_root) / spec.id, needed_bytes=snapshot_bytes(plan, spec))
        if full is not None:
            raise full from None
        raise
    except sqlite3.OperationalError as e:
        if "full" in str(e):
            raise DiskFullError(f"{catalog.path}: no space left on the device to record the snapshot") from None
        raise
    clock.lap("publish")
    return PublishedDataset(
        snapshot, files.sha256, files.manifest, files.report, checks, passed, True, sorted(linked)
    )


@contextmanager
def _publishing(spec_dir: Path, wait_s: float = 300.0) -> Iterator[None]:
    """Hold the spec's snapshot directory shared from staging to the catalog record, so ``gc``
    (which takes it exclusively) never sees a snapshot half published."""
    with dir_lock(spec_dir, shared=True, wait_s=wait_s) as locked:
        if not locked:
            raise BuildError(f"{spec_dir}: gc is removing old snapshots; waited {wait_s:g} s", code="DATASETS_BUSY")
        yield


def snapshot_bytes(plan: DatasetPlan, spec: DatasetSpec) -> int:
    """About how many bytes a snapshot of ``plan`` takes (its arrays; the series layout's rows:
    at most ``min(stride, H)`` history and ``min(stride, F)`` future rows a window, plus a
    window's whole rows per run)."""
    n = sum(int(plan.split[p]) for p in ("train", "val", "test"))
    H, F, stride = spec.history_steps, spec.horizon_steps, spec.stride
    future_cols = len(spec.control_ids) + len(spec.target_ids)
    if spec.layout == SERIES_LAYOUT:
        runs = len(plan.runs)
        rows = 4 * (min(stride, H) * len(spec.nodes) + min(stride, F) * future_cols)
        return n * rows + runs * 4 * (H * len(spec.nodes) + F * future_cols)
    per_window = 4 * (H * len(spec.nodes) + F * future_cols)
    if spec.extras is not None:
        per_window += 12 * (H + F)
    return n * per_window


def _shareable(current: CatalogEntry | None, keys: dict[str, str]) -> dict[str, Path]:
    """Files of the current snapshot whose inputs equal those of the file about to be written."""
    if current is None:
        return {}
    root = Path(current.path)
    try:
        previous = json.loads((root / DIGEST_FILE).read_bytes()).get("fileKeys") or {}
    except (OSError, ValueError):
        return {}
    return {name: root / name for name, k in keys.items() if previous.get(name) == k and (root / name).is_file()}


def _unchanged(entry: CatalogEntry) -> PublishedDataset:
    root = Path(entry.path)
    manifest = json.loads((root / "manifest.json").read_bytes())
    try:
        report = json.loads((root / "report.json").read_bytes())
    except (OSError, ValueError):
        report = {}
    recorded = entry.checks or {}
    checks = [
        CheckOutcome(
            name,
            bool(c.get("passed")),
            f"unchanged snapshot (nothing new since {entry.created_at}); at publication: {c.get('description', '')}",
        )
        for name, c in recorded.items()
    ]
    return PublishedDataset(root, entry.sha256, manifest, report, checks, entry.current, published=False)


class _Clock:
    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[name] = self.timings.get(name, 0.0) + (now - self.t)
        self.t = now
