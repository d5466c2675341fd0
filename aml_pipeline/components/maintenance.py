"""Maintenance: the ``aml_gc`` job keeps disk bounded (old snapshots, obsolete intermediates) and
the Dagster instance too (:func:`prune_instance`: superseded runs older than the retention)."""

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import dagster as dg

from aml_pipeline import config as settings
from aml_pipeline.components.dagster_internals import delete_check_executions, delete_run_files, run_event_records
from aml_pipeline.components.resources import StoreResource
from aml_pipeline.components.schedules import build_job_name, rebuild_job_name, runs_job_name, verify_job_name
from aml_pipeline.components.shared_env import REBUILD_JOB, SHARED_ENV_KEY
from aml_pipeline.components.sources import OBSERVE_JOB, TSDB_POINTS
from aml_pipeline.pipeline.retention import DEFAULT_KEEP, collect_garbage
from aml_pipeline.spec import DatasetSpec

# The dataset specs of the code location loaded in this process, wherever they were written (a
# specs folder, a defs.yaml, a project's own Python): building a dataset's definitions registers
# its spec here, so gc cleans the intermediates of every one. Dagster loads the code location in
# each process that runs the gc job, before the job runs.
_CODE_LOCATION_SPECS: dict[str, DatasetSpec] = {}


def register_spec(spec: DatasetSpec) -> None:
    """Make ``spec`` known to gc (called for every dataset's definitions)."""
    _CODE_LOCATION_SPECS[spec.id] = spec


def code_location_specs() -> dict[str, DatasetSpec]:
    """The specs gc keeps the intermediates of, by id."""
    return dict(_CODE_LOCATION_SPECS)


GC_JOB = "aml_gc"
# What a UI launches when a person materialises a selection of assets (not one of the named jobs).
ASSET_JOB = "__ASSET_JOB"
_FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
_ASSET_EVENTS = (dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_OBSERVATION)
_CHECK_EVENTS = (dg.DagsterEventType.ASSET_CHECK_EVALUATION_PLANNED, dg.DagsterEventType.ASSET_CHECK_EVALUATION)


def project_job_names(spec_ids: Iterable[str]) -> set[str]:
    """The jobs whose runs this project makes: each spec's four jobs, gc, the TSDB observation and
    the shared environment's rebuild."""
    names = {GC_JOB, OBSERVE_JOB, REBUILD_JOB}
    for spec_id in spec_ids:
        names |= {runs_job_name(spec_id), build_job_name(spec_id), rebuild_job_name(spec_id), verify_job_name(spec_id)}
    return names


@dataclass
class InstancePruneReport:
    """What :func:`prune_instance` deleted (or, dry, would delete)."""

    deleted_runs: list[str] = field(default_factory=list)
    kept_runs: int = 0  # runs older than the retention kept: they hold a latest event
    # the deleted runs' events, serialised (what the event log stores of them), their check
    # evaluations counted twice (the check table keeps a copy of each)
    freed_bytes: int = 0
    retention_days: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "dryRun": self.dry_run,
            "retentionDays": self.retention_days,
            "deletedRuns": self.deleted_runs,
            "keptOldRuns": self.kept_runs,
            "freedBytes": self.freed_bytes,
        }


def _project_run(run: dg.DagsterRun, jobs: set[str], spec_ids: set[str]) -> bool:
    if run.job_name in jobs:
        return True
    # a UI's materialisation of a selection: the project's when every selected asset is
    keys = run.asset_selection or set()
    own = {TSDB_POINTS, SHARED_ENV_KEY}
    return run.job_name == ASSET_JOB and bool(keys) and all(k in own or k.path[0] in spec_ids for k in keys)


class _Latest:
    """The storage id of the latest materialisation / observation of each asset partition, and the
    run of the latest evaluation of each check, asked of the instance once per asset or check."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self._by_partition: dict[tuple[Any, dg.AssetKey], dict[str, int]] = {}
        self._unpartitioned: dict[tuple[Any, dg.AssetKey], int] = {}
        self._check_runs: dict[dg.AssetCheckKey, str | None] = {}

    def storage_id(self, event_type: dg.DagsterEventType, key: dg.AssetKey, partition: str | None) -> int:
        if partition is not None:
            if (event_type, key) not in self._by_partition:
                self._by_partition[event_type, key] = dict(
                    self.instance.get_latest_storage_id_by_partition(key, event_type)
                )
            return self._by_partition[event_type, key].get(partition, -1)
        if (event_type, key) not in self._unpartitioned:
            fetch = (self.instance.fetch_materializations
                     if event_type == dg.DagsterEventType.ASSET_MATERIALIZATION else self.instance.fetch_observations)
            records = fetch(key, limit=1).records
            self._unpartitioned[event_type, key] = records[0].storage_id if records else -1
        return self._unpartitioned[event_type, key]

    def check_run(self, check: dg.AssetCheckKey) -> str | None:
        if check not in self._check_runs:
            record = self.instance.get_latest_asset_check_evaluation_record(check)
            self._check_runs[check] = record.run_id if record is not None else None
        return self._check_runs[check]


def _superseded(records: list[Any], run_id: str, latest: _Latest) -> bool:
    """Whether a newer event of the same asset partition (check) superseded each materialisation,
    observation and check evaluation among the run's event ``records``."""
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is None or event.event_type not in (*_ASSET_EVENTS, dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            continue
        if event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
            if latest.check_run(event.asset_check_evaluation_data.asset_check_key) == run_id:
                return False
        elif record.asset_key is not None and record.storage_id >= latest.storage_id(
            event.event_type, record.asset_key, record.partition_key
        ):
            return False
    return True


def prune_instance(
    instance: dg.DagsterInstance,
    spec_ids: Iterable[str],
    *,
    retention_days: int,
    now: datetime | None = None,
    dry_run: bool = False,
) -> InstancePruneReport:
    """Delete (``delete_run``) the finished runs of this project's jobs created more than
    ``retention_days`` before ``now`` whose every materialisation, observation and check evaluation
    is superseded: a newer one of the same asset partition (check) exists, with the run's check
    executions, which ``delete_run`` leaves. The latest of each stays with its run, as does every
    run within the retention (failed ones included) and every run of another job."""
    if retention_days < 1:
        raise ValueError(f"retention_days must be >= 1, got {retention_days}")
    spec_ids = set(spec_ids)
    jobs = project_job_names(spec_ids)
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=retention_days)
    report = InstancePruneReport(retention_days=retention_days, dry_run=dry_run)
    latest = _Latest(instance)
    for job in sorted(jobs | {ASSET_JOB}):
        old = instance.get_run_records(dg.RunsFilter(job_name=job, statuses=_FINISHED, created_before=cutoff))
        for record in old:
            run = record.dagster_run
            if not _project_run(run, jobs, spec_ids):
                continue
            records = run_event_records(instance, run.run_id)  # read once: decided on, then counted
            if not _superseded(records, run.run_id, latest):
                report.kept_runs += 1
                continue
            report.freed_bytes += sum(
                len(dg.serialize_value(r.event_log_entry))
                * (2 if r.event_log_entry.dagster_event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION else 1)
                for r in records
            )
            report.deleted_runs.append(run.run_id)
            if not dry_run:
                _delete_run(instance, run.run_id, records)
    return report


def _delete_run(instance: dg.DagsterInstance, run_id: str, records: list[Any]) -> None:
    """``delete_run``, and what Dagster keeps of the run beside its events: its check executions
    (a row per check with a copy of the evaluation; never the latest of a check), its captured
    step logs, and on SQLite storage its own event-log file (empty once its events are deleted,
    though as large on disk as the run's events were)."""
    checks = {r.event_log_entry.dagster_event.event_specific_data.asset_check_key for r in records
              if r.event_log_entry.dagster_event_type in _CHECK_EVENTS}
    instance.delete_run(run_id)
    delete_check_executions(instance, run_id, checks)
    delete_run_files(instance, run_id)


class GcConfig(dg.Config):
    keep: int = DEFAULT_KEEP
    """Non-current snapshots to keep per spec (the newest ones)."""
    dry_run: bool = False
    retention_days: int | None = None
    """Days every run of this project stays in the instance (default: ``AML_INSTANCE_RETENTION_DAYS``)."""


@dg.op(
    out=dg.Out(dg.Nothing),
    description="Remove non-current snapshots beyond the newest `keep` and intermediates no current stage version "
    "needs; delete this project's superseded runs older than the instance retention.",
)
def collect_garbage_op(context: dg.OpExecutionContext, config: GcConfig, store: StoreResource):
    report = collect_garbage(
        store.datasets_root, settings.store_dir(store.home_path), code_location_specs(),
        keep=config.keep, dry_run=config.dry_run,
    )
    pruned = prune_instance(
        context.instance, code_location_specs(), dry_run=config.dry_run,
        retention_days=config.retention_days or settings.instance_retention_days(),
    )
    verb = "would remove" if report.dry_run else "removed"
    context.log.info(
        f"{verb} {len(report.removed_snapshots)} snapshot(s), "
        f"{len(report.removed_stages)} stage(s), {len(report.removed_other)} leftover(s); "
        f"{report.freed_bytes / 1e6:.1f} MB" + (f"; skipped: {'; '.join(report.skipped)}" if report.skipped else "")
    )
    context.log.info(instance_summary(pruned))
    yield dg.Output(
        None,
        metadata={
            "removed_snapshots": len(report.removed_snapshots),
            "removed_stages": len(report.removed_stages),
            "freed_mb": round(report.freed_bytes / 1e6, 1),
            "skipped": "; ".join(report.skipped) or "-",
            "deleted_runs": len(pruned.deleted_runs),
            "event_log_freed_mb": round(pruned.freed_bytes / 1e6, 1),
            "report": dg.MetadataValue.json({**report.to_json(), "instance": pruned.to_json()}),
        },
    )


def instance_summary(report: InstancePruneReport) -> str:
    """One line: the runs :func:`prune_instance` deleted (would delete), what their events took."""
    verb = "would delete" if report.dry_run else "deleted"
    return (
        f"Dagster instance: {verb} {len(report.deleted_runs)} superseded run(s) older than "
        f"{report.retention_days} days ({report.freed_bytes / 1e6:.1f} MB of events); "
        f"kept {report.kept_runs} older run(s) holding a partition's latest materialisation, observation or check"
    )


@dg.job(
    name=GC_JOB,
    description="Retention: old snapshots, obsolete per-run intermediates and superseded runs in the instance "
    "(see `aml-pipeline gc`).",
)
def gc_job() -> None:
    collect_garbage_op()


gc_schedule = dg.ScheduleDefinition(
    name="aml_gc_schedule",
    job=gc_job,
    cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Runs aml_gc daily at 03:00 (off until turned on).",
)
