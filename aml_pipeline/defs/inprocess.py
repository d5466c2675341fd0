"""Materialising one dataset's assets in this process (the CLI's ``build`` and ``demo``).

The same asset definitions the UI shows, executed with ``dg.materialize`` in one run: the run
partitions as a single-run backfill (a partition range), then the dataset assets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from aml_pipeline.defs.assets import DATASET_ASSETS, RUN_ASSETS, dataset_assets
from aml_pipeline.defs.partitions import run_partitions
from aml_pipeline.defs.resources import StoreResource, TsdbResource
from aml_pipeline.defs.sources import tsdb_points
from aml_pipeline.errors import AmlError, BuildError
from aml_pipeline.pipeline.build import run_scope
from aml_pipeline.pipeline.runs import check_nodes_known
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb import open_tsdb

# Public run tags that make one run cover a range of partitions (a single-run backfill).
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


def sync_run_partitions(instance: dg.DagsterInstance, spec: DatasetSpec, run_ids: list[str]) -> list[str]:
    """Make the spec's run partitions exactly ``run_ids`` (the runs in scope now)."""
    name = run_partitions(spec.id).name
    existing = instance.get_dynamic_partitions(name)
    wanted = set(run_ids)
    for key in existing:
        if key not in wanted:
            instance.delete_dynamic_partition(name, key)
    have = set(existing)
    new = [r for r in run_ids if r not in have]
    if new:
        instance.add_dynamic_partitions(name, new)
    return instance.get_dynamic_partitions(name)


def user_error(exc: BaseException) -> AmlError | None:
    """The AmlError behind a Dagster step failure, if a user error caused it."""
    seen = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, AmlError):
            return e
        stack.extend([getattr(e, "user_exception", None), e.__cause__, e.__context__])
    return None


def materialize_dataset(
    spec: DatasetSpec,
    *,
    tsdb_url: str,
    home: Path,
    datasets_dir: Path | None = None,
    instance: dg.DagsterInstance | None = None,
    console_log_level: str = "INFO",
) -> dict[str, Any]:
    """Build and publish ``spec`` through its Dagster assets; return the build summary.

    Everything is recorded in ``instance`` (the run log, materialisations, checks); the console
    shows Dagster's log at ``console_log_level`` (the CLI passes CRITICAL and draws progress bars).
    """
    with open_tsdb(tsdb_url) as db:
        check_nodes_known(spec, db.list_nodes())
        runs = db.list_runs(run_scope(spec), finished_only=True)
    if not runs:
        raise BuildError(f"spec {spec.id!r}: no finished runs in scope {run_scope(spec)}", code="NO_RUNS")
    resources = {
        "tsdb": TsdbResource(url=tsdb_url),
        "store": StoreResource(home=str(home), datasets_dir=str(datasets_dir) if datasets_dir else None),
    }
    assets = [*dataset_assets(spec), tsdb_points]
    own = instance is None
    instance = instance or dg.DagsterInstance.ephemeral()
    try:
        keys = sync_run_partitions(instance, spec, [r.run_id for r in runs])
        # One run: the run assets over the range of all partitions (a single-run backfill, one
        # step per asset looping the runs), then the dataset assets over them.
        try:
            result = dg.materialize(
                assets,
                instance=instance,
                resources=resources,
                selection=[dg.AssetKey([spec.id, n]) for n in (*RUN_ASSETS, *DATASET_ASSETS)],
                tags={RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]},
                run_config={"loggers": {"console": {"config": {"log_level": console_log_level}}}},
            )
        except Exception as e:
            err = user_error(e)
            if err is not None:
                raise err from e
            raise
        for event in result.get_asset_materialization_events():
            mat = event.materialization
            if mat.asset_key == dg.AssetKey([spec.id, "dataset_manifest"]):
                summary = dict(mat.metadata["summary"].value)
                if not summary.get("current"):
                    failed = [name for name, ok in summary["checks"].items() if not ok]
                    raise BuildError(
                        f"spec {spec.id!r}: snapshot {summary['snapshotDir']} failed blocking checks: {', '.join(failed)}",
                        code="CHECK_FAILED",
                    )
                return summary
        raise BuildError(f"spec {spec.id!r}: dataset_manifest was not materialised")
    finally:
        if own:
            instance.dispose()
