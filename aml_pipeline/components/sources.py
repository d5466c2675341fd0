"""The TSDB as an observable source asset, upstream of every ``dataset_manifest``.

Its data version is the availability watermark (the latest point timestamp), which a v2 snapshot
records as provenance. It is deliberately not upstream of the run stages: any ingest moves the
watermark, which would mark every run stale; whether one run must be rebuilt is decided by that
run's own version in the TSDB (``TsdbPort.run_versions``, see docs/operations.md). It is observed
by the job ``observe_tsdb``: by the demo right after seeding, and by the schedule
``observe_tsdb_schedule`` every 15 minutes (running by default; a tick launches nothing when the
TSDB is unreachable or its watermark has not moved since the last observation), so the UI shows
the watermark and when it last changed instead of "Never observed".
"""

from __future__ import annotations

import datetime as _dt

import dagster as dg

from aml_pipeline.components.assets import TSDB_POINTS
from aml_pipeline.components.dagster_internals import beta_api
from aml_pipeline.components.resources import TsdbResource
from aml_pipeline.errors import AmlError
from aml_pipeline.urls import redact_url

OBSERVE_JOB = "observe_tsdb"
OBSERVE_CRON = "*/15 * * * *"


def _version(watermark: int | None) -> str:
    return str(watermark) if watermark is not None else "empty"


# The source asset's API is beta; its warning is silenced (dagster_internals.beta_api says why; the
# CLI filters it only in its own process).
with beta_api():

    # The multi form with one spec: the single form is converted to an asset through a Dagster
    # path that reads a deprecated op property on every load.
    @dg.multi_observable_source_asset(
        specs=[dg.AssetSpec(
            TSDB_POINTS,
            group_name="tsdb",
            description="Points, runs and nodes in the plant's time-series database. Observed by its "
            "availability watermark (the latest point timestamp), which each snapshot records as provenance; "
            "each run's own TSDB version decides whether that run is rebuilt.",
        )],
        name="tsdb_points",
    )
    def tsdb_points(tsdb: TsdbResource) -> dg.ObserveResult:
        with tsdb.open() as db:
            watermark = db.availability_watermark()
            runs = db.list_runs(None, finished_only=False)
            nodes = db.list_nodes()
        finished = sum(r.finished for r in runs)
        metadata: dict[str, object] = {
            "tsdb": redact_url(tsdb.url),
            "watermark_ms": watermark if watermark is not None else -1,
            "runs_finished": finished,
            "runs_in_progress": len(runs) - finished,
            "nodes": len(nodes),
        }
        if watermark is not None:
            metadata["watermark"] = dg.MetadataValue.timestamp(
                _dt.datetime.fromtimestamp(watermark / 1000, tz=_dt.timezone.utc)
            )
        return dg.ObserveResult(asset_key=TSDB_POINTS, data_version=dg.DataVersion(_version(watermark)), metadata=metadata)


observe_tsdb_job = dg.define_asset_job(
    OBSERVE_JOB,
    selection=dg.AssetSelection.assets(TSDB_POINTS),
    description="Observe the TSDB: record its availability watermark (the data version of tsdb/points).",
)


@dg.schedule(
    name=f"{OBSERVE_JOB}_schedule",
    job=observe_tsdb_job,
    cron_schedule=OBSERVE_CRON,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Observes the TSDB every 15 minutes when its watermark has moved, so the UI shows how "
    "far the plant's data reaches.",
)
def observe_tsdb_schedule(context: dg.ScheduleEvaluationContext, tsdb: TsdbResource):
    try:
        with tsdb.open() as db:
            watermark = db.availability_watermark()
    except AmlError as e:
        return dg.SkipReason(f"the TSDB cannot be read: {e.one_line()}")
    last = context.instance.fetch_observations(TSDB_POINTS, limit=1).records
    if last and last[0].asset_observation.data_version == _version(watermark):
        return dg.SkipReason(f"watermark unchanged ({_version(watermark)}) since the last observation")
    return dg.RunRequest()


def observe_tsdb(instance: dg.DagsterInstance, tsdb_url: str, *, console_log_level: str = "INFO") -> str:
    """Run ``observe_tsdb`` in this process, recorded in ``instance``; returns the data version."""
    defs = dg.Definitions(assets=[tsdb_points], jobs=[observe_tsdb_job], resources={"tsdb": TsdbResource(url=tsdb_url)})
    defs.resolve_job_def(OBSERVE_JOB).execute_in_process(
        instance=instance, run_config={"loggers": {"console": {"config": {"log_level": console_log_level}}}}
    )
    [record] = instance.fetch_observations(TSDB_POINTS, limit=1).records
    return record.asset_observation.data_version or ""
