"""Publishing a dataset (shared by the Dagster manifest asset and the library build).

``publish_dataset`` writes the snapshot into a staging directory, runs the blocking checks on
the written bytes (read back from disk while the fsyncs finish), renames the directory into
place and only then, if the checks passed, makes it ``current`` in the catalog. A rebuild whose
inputs (stage versions, runs, their data versions) equal those of the current snapshot publishes
nothing; array files whose inputs did not change are hard links to the previous snapshot's.
``build_dataset`` is the library-only end-to-end build (every stage in one process, no Dagster),
incremental like the Dagster build: the benchmark's reference for the Dagster build.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aml_pipeline.core.hashing import DIGEST_FILE, SnapshotDigest
from aml_pipeline.errors import BuildError, DiskFullError, disk_full
from aml_pipeline.fsutil import dir_lock
from aml_pipeline.pipeline.checks import CheckOutcome, snapshot_checks
from aml_pipeline.pipeline.dataset import (
    DatasetPlan,
    Normalization,
    array_name,
    fit_or_reuse_normalization,
    plan_dataset,
    save_plan,
    write_snapshot_files,
)
from aml_pipeline.pipeline.incremental import inputs_key, stale_runs, stages_from
from aml_pipeline.pipeline.publish import Catalog, CatalogEntry, publish_staged, set_current, staging_dir
from aml_pipeline.pipeline.runs import build_runs, check_nodes_known, run_fetcher
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.pipeline.versions import ALGORITHMS, stage_versions
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT, RunScope, TsdbPort


def run_scope(spec: DatasetSpec) -> RunScope:
    return RunScope(spec.line_id, spec.product_id, spec.recipe_id, spec.from_ms, spec.to_ms)


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
            "windows": {p: split[p] for p in ("train", "val", "test")},
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


def build_key(spec: DatasetSpec, plan: DatasetPlan, norm: Normalization) -> str:
    """Everything a snapshot's content depends on, except its capture time and the TSDB's global
    watermark: the manifest stage's version (spec and code), the plan (runs, split, data
    versions) and the statistics applied. Equal keys, equal data: nothing new to publish."""
    return inputs_key(stage_versions(spec).manifest, plan.key(spec), norm.to_json(spec))


def file_keys(spec: DatasetSpec, plan: DatasetPlan, norm: Normalization) -> dict[str, str]:
    """What each array file is computed from (equal key, equal bytes): shared by hard link."""
    stats = norm.to_json(spec)
    base = (ALGORITHMS["manifest"], plan.key(spec))
    keys = {array_name(k): inputs_key(k, *base, stats[k]) for k in ("x", "u", "y")}
    if spec.extras is not None:
        keys.update({array_name(k): inputs_key(k, *base) for k in ("timestamps", "mask")})
    return keys


def publish_dataset(
    spec: DatasetSpec,
    plan: DatasetPlan,
    norm: Normalization,
    store: DatasetStore,
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
    key = build_key(spec, plan, norm)
    catalog = Catalog(datasets_root)
    current = catalog.current(spec.id)
    if current is not None and current.build_key == key:
        return _unchanged(current)
    clock = _Clock(timings)
    captured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    keys = file_keys(spec, plan, norm)
    try:
        with _publishing(Path(datasets_root) / spec.id), staging_dir(datasets_root, spec.id) as staging:
            # Under the lock: gc cannot remove a file between choosing it and linking it.
            linked = _shareable(catalog.current(spec.id), keys)
            files = write_snapshot_files(
                spec, plan, norm, store, staging,
                availability_watermark=availability_watermark, captured_at=captured_at, wait_durable=False,
                linked=linked,
            )
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
            catalog.record(
                snapshot, files.manifest, files.sha256, current=passed, build_key=key,
                checks={c.name: c.to_json() for c in checks},
            )
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
    """About how many bytes a snapshot of ``plan`` takes (its arrays)."""
    n = sum(int(plan.split[p]) for p in ("train", "val", "test"))
    H, F = spec.history_steps, spec.horizon_steps
    per_window = 4 * (H * len(spec.nodes) + F * (len(spec.control_ids) + len(spec.target_ids)))
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


Progress = Callable[[str, int, int], None]


def build_dataset(
    spec: DatasetSpec,
    tsdb: TsdbPort,
    *,
    store_root: Path,
    datasets_root: Path,
    page_limit: int = DEFAULT_PAGE_LIMIT,
    progress: Progress | None = None,
    full: bool = False,
) -> PublishedDataset:
    """Every stage in this process, run after run, then publish (no Dagster).

    Incremental: only runs with a stale stage are processed, from that stage on (``full``
    rebuilds every run), and nothing is published when nothing changed.
    """
    store = DatasetStore(store_root, spec.id)
    with store.in_use():
        return _build(spec, tsdb, store, datasets_root, page_limit, progress, full)


def _build(spec, tsdb, store, datasets_root, page_limit, progress, full) -> PublishedDataset:
    catalog = check_nodes_known(spec, tsdb.list_nodes())
    runs = tsdb.list_runs(run_scope(spec), finished_only=True)
    if not runs:
        raise BuildError(f"spec {spec.id!r}: no finished runs in scope {run_scope(spec)}", code="NO_RUNS")
    versions = tsdb.run_versions([r.run_id for r in runs])
    todo = (
        dict.fromkeys((r.run_id for r in runs), "raw")
        if full
        else stale_runs(spec, store, runs, tsdb_versions=versions, catalog=catalog)
    )
    work = [(r.run_id, stages_from(todo[r.run_id])) for r in runs if r.run_id in todo]
    fetch = run_fetcher(tsdb, spec, store, runs, catalog, page_limit=page_limit, tsdb_versions=versions)
    with closing(build_runs(spec, store, work, fetch)) as results:
        for i, run in enumerate(runs):
            if run.run_id in todo:
                result = next(results)
                if result.error is not None:
                    raise result.error
            if progress:
                progress(run.run_id, i + 1, len(runs))
    plan = plan_dataset(spec, [r.run_id for r in runs], store)
    save_plan(spec, plan, store)
    norm, _ = fit_or_reuse_normalization(spec, plan, store)
    published = publish_dataset(
        spec, plan, norm, store, datasets_root, availability_watermark=tsdb.availability_watermark()
    )
    if not published.current:
        failed = [c for c in published.checks if not c.passed]
        raise BuildError(
            f"spec {spec.id!r}: snapshot {published.snapshot_dir} failed blocking checks "
            + "; ".join(f"{c.name}: {c.description}" for c in failed),
            code="CHECK_FAILED",
        )
    return published
