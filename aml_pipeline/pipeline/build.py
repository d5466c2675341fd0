"""Publishing a dataset (shared by the Dagster manifest asset and the library build).

``publish_dataset`` writes the snapshot into a staging directory, runs the blocking checks on
the written bytes (read back from disk while the fsyncs finish), renames the directory into
place and only then, if the checks passed, makes it ``current`` in the catalog.
``build_dataset`` is the library-only end-to-end build (all stages in one process, no Dagster),
used by the benchmark as the reference the Dagster build is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aml_pipeline.core.hashing import SnapshotDigest
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.checks import CheckOutcome, snapshot_checks
from aml_pipeline.pipeline.dataset import (
    DatasetPlan,
    Normalization,
    fit_normalization,
    plan_dataset,
    save_norm,
    save_plan,
    write_snapshot_files,
)
from aml_pipeline.pipeline.publish import Catalog, publish_staged, set_current, staging_dir
from aml_pipeline.pipeline.runs import check_nodes_known, clean_run, fetch_run, window_run
from aml_pipeline.pipeline.store import DatasetStore
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
            "checks": {c.name: c.passed for c in self.checks},
        }


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

    The checks read the written files back (every byte, independently of the writer) while
    the disk is still making them durable; the directory is renamed into place once the
    files are fsynced, whatever the checks found (a failed snapshot stays for inspection, not
    current). ``timings``, if given, receives the seconds of ``write`` (until every byte is
    written and hashed), ``checks``, ``durable`` (what was left of the fsyncs after the
    checks) and ``publish`` (rename, ``current``, catalog).
    """
    clock = _Clock(timings)
    captured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with staging_dir(datasets_root, spec.id) as staging:
        files = write_snapshot_files(
            spec, plan, norm, store, staging,
            availability_watermark=availability_watermark, captured_at=captured_at, wait_durable=False,
        )
        clock.lap("write")
        try:
            checks = snapshot_checks(spec, staging, files.sha256, store, files.files)
            clock.lap("checks")
        finally:
            files.wait_durable()
        clock.lap("durable")
        snapshot = publish_staged(staging, SnapshotDigest(files.sha256, files.files))
    passed = all(c.passed for c in checks if c.blocking)
    if passed:
        set_current(snapshot)
    Catalog(datasets_root).record(snapshot, files.manifest, files.sha256, current=passed)
    clock.lap("publish")
    return PublishedDataset(snapshot, files.sha256, files.manifest, files.report, checks, passed)


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
) -> PublishedDataset:
    """Every stage in this process, run after run, then publish (no Dagster)."""
    store = DatasetStore(store_root, spec.id)
    catalog = check_nodes_known(spec, tsdb.list_nodes())
    runs = tsdb.list_runs(run_scope(spec), finished_only=True)
    if not runs:
        raise BuildError(f"spec {spec.id!r}: no finished runs in scope {run_scope(spec)}", code="NO_RUNS")
    for i, run in enumerate(runs):
        fetch_run(tsdb, spec, run, store, catalog, page_limit=page_limit)
        clean_run(spec, run.run_id, store)
        window_run(spec, run.run_id, store)
        if progress:
            progress(run.run_id, i + 1, len(runs))
    plan = plan_dataset(spec, [r.run_id for r in runs], store)
    save_plan(spec, plan, store)
    norm = fit_normalization(spec, plan, store)
    save_norm(spec, norm, store)
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
