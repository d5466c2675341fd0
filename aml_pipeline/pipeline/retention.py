"""Retention: keep disk bounded when a dataset is rebuilt for months.

Per spec, ``collect_garbage`` removes the snapshots that are neither ``current`` nor among the
newest ``keep`` others, and the per-run intermediates that the spec's current stage versions do
not need (stages built for an edited spec, temporary files of killed builds, files a current
stage no longer writes).

Safety:

* It never touches ``current``, nor a snapshot being built: publication holds a shared lock on the
  spec's snapshot directory from staging to the catalog record, gc an exclusive one (it skips a spec
  it cannot lock within ``wait_s``, saying so). Builds hold a shared lock on the spec's
  intermediates the same way.
* A SIGKILL at any moment leaves catalog and disk consistent: a snapshot's catalog row is deleted
  (committed) before its directory is renamed to a hidden ``.trash-*`` name and removed, so every
  catalog row names a complete snapshot; an interrupted gc leaves at most hidden trash or an
  uncatalogued complete snapshot, which the next gc removes.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aml_pipeline.faults import crash_point
from aml_pipeline.fsutil import dir_lock, fsync_dir, remove_tree
from aml_pipeline.pipeline.publish import (
    CURRENT_LINK,
    Catalog,
    CatalogEntry,
    remove_abandoned_staging,
)
from aml_pipeline.pipeline.registry import RUN_STAGES
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec

DEFAULT_KEEP = 3
TRASH_PREFIX = ".trash-"


@dataclass
class GcReport:
    removed_snapshots: list[str] = field(default_factory=list)
    removed_stages: list[str] = field(default_factory=list)  # "<spec>/<run>/<stage>"
    removed_other: list[str] = field(default_factory=list)  # trash, staging, temporary files
    freed_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # "<spec>: why"
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "dryRun": self.dry_run,
            "removedSnapshots": self.removed_snapshots,
            "removedStages": self.removed_stages,
            "removedOther": self.removed_other,
            "freedBytes": self.freed_bytes,
            "skipped": self.skipped,
        }


def collect_garbage(
    datasets_root: Path,
    store_root: Path,
    specs: Mapping[str, DatasetSpec],
    *,
    keep: int = DEFAULT_KEEP,
    dry_run: bool = False,
    wait_s: float = 10.0,
) -> GcReport:
    """Remove what no current version needs; see the module docstring."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    report = GcReport(dry_run=dry_run)
    datasets_root, store_root = Path(datasets_root), Path(store_root)
    spec_ids = sorted({*_spec_dirs(datasets_root), *specs})
    for spec_id in spec_ids:
        _snapshots(datasets_root, spec_id, keep, dry_run, wait_s, report)
    for spec_id in sorted(_spec_dirs(store_root)):
        spec = specs.get(spec_id)
        if spec is None:
            report.skipped.append(f"{spec_id}: intermediates left alone (no known spec defines it)")
            continue
        _intermediates(DatasetStore(store_root, spec), dry_run, wait_s, report)
    return report


def _spec_dirs(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` that no other name shares (a hard-linked file is freed
    only with its last name)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if st.st_nlink <= 1:
                total += st.st_size
    return total


def _snapshots(root: Path, spec_id: str, keep: int, dry_run: bool, wait_s: float, report: GcReport) -> None:
    spec_dir = root / spec_id
    if not spec_dir.is_dir():
        return
    with dir_lock(spec_dir, shared=False, wait_s=wait_s) as locked:
        if not locked:
            report.skipped.append(f"{spec_id}: snapshots left alone (a build is publishing; try again)")
            return
        catalog = Catalog(root)
        entries = [e for e in catalog.entries(spec_id)]
        current = (spec_dir / CURRENT_LINK).resolve() if (spec_dir / CURRENT_LINK).is_symlink() else None
        others = [e for e in entries if _in_root(spec_dir, e).resolve() != current]
        others.sort(key=lambda e: (e.created_at, e.sha256), reverse=True)
        for entry in others[keep:]:
            path = _in_root(spec_dir, entry)
            report.removed_snapshots.append(str(path))
            if dry_run:
                report.freed_bytes += _size(path) if path.is_dir() else 0
                continue
            catalog.delete(spec_id, entry.sha256)  # first: a catalog row always names a snapshot
            crash_point("gc.catalog_row_removed")
            report.freed_bytes += _discard(path)
        catalogued = {_in_root(spec_dir, e).resolve() for e in catalog.entries(spec_id)}
        for path in sorted(spec_dir.iterdir()):
            name = path.name
            if path.is_symlink() or not path.is_dir():
                continue
            if name.startswith((TRASH_PREFIX, ".broken-")) or (
                not name.startswith(".") and path.resolve() not in catalogued and path.resolve() != current
            ):
                # Trash of an interrupted gc, a snapshot replaced because it was damaged, or a
                # complete snapshot whose catalog row an interrupted gc already deleted.
                report.removed_other.append(str(path))
                if not dry_run:
                    report.freed_bytes += _discard(path)
        if not dry_run:
            report.removed_other += [str(p) for p in remove_abandoned_staging(spec_dir)]


def _in_root(spec_dir: Path, entry: CatalogEntry) -> Path:
    """The directory of a catalogued snapshot in this datasets root: ``<spec dir>/<its name>``.
    A datasets root that was copied or moved keeps its catalog, whose paths still name the old
    place: taken as they are, gc would delete snapshots of the other root and take this root's
    own for uncatalogued leftovers (the lookup by name is what ``catalog_sha256`` does too)."""
    return spec_dir / Path(entry.path).name


def _discard(path: Path) -> int:
    """Hide ``path`` with one rename, then remove it; returns the bytes freed."""
    if not path.exists():
        return 0
    size = _size(path)
    trash = path if path.name.startswith(TRASH_PREFIX) else path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    if trash != path:
        os.rename(path, trash)
        fsync_dir(path.parent)
        crash_point("gc.moved_to_trash")
    remove_tree(trash)
    crash_point("gc.deleted")
    return size


def _intermediates(store: DatasetStore, dry_run: bool, wait_s: float, report: GcReport) -> None:
    spec = store.spec
    with dir_lock(store.dir, shared=False, wait_s=wait_s) as locked:
        if not locked:
            report.skipped.append(f"{spec.id}: intermediates left alone (a build is running; try again)")
            return
        runs_dir = store.dir / "runs"
        if not runs_dir.is_dir():
            return
        for run_dir in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
            for tmp in run_dir.glob(".*.tmp"):  # a killed build's half-written file
                report.removed_other.append(str(tmp))
                if not dry_run:
                    report.freed_bytes += tmp.stat().st_size
                    tmp.unlink(missing_ok=True)
            for stage in RUN_STAGES:
                meta = store.read_meta(run_dir.name, stage)
                summary = store.meta_path(run_dir.name, stage)
                files = sorted(f for f in run_dir.glob(f"{stage}.*") if f != summary)
                if store.versions.is_current(stage, meta):
                    # A current stage keeps its files; one it no longer writes (raw.seq.npy of a
                    # store built before the raw stage stopped storing the ingest order) goes.
                    written = {f"{stage}.{name}{ext}" for name in stage.files for ext in ("", ".npy")}
                    for f in files:
                        if f.name not in written:
                            report.removed_other.append(str(f))
                            report.freed_bytes += f.stat().st_size
                            if not dry_run:
                                f.unlink(missing_ok=True)
                    continue
                if meta is None and not files:
                    continue
                report.removed_stages.append(f"{spec.id}/{run_dir.name}/{stage}")
                for f in [summary, *files]:  # the summary first
                    if f.exists():
                        report.freed_bytes += f.stat().st_size
                        if not dry_run:
                            f.unlink()
            if not dry_run and not any(run_dir.iterdir()):
                run_dir.rmdir()
