"""Every use of Dagster beyond its public API, in one place.

The rest of the package uses only what Dagster marks public (``@public`` methods of
``DagsterInstance``, the names ``dagster`` exports). What is here has no public equivalent that
does the same job at the same cost; each item says why it is needed, and
``aml_pipeline_tests/components/test_dagster_internals.py`` has a test per item that fails when a
Dagster upgrade changes what it relies on (the method's signature and behaviour, the switch still
read by Dagster's source, the API still beta).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

# ---- Dagster's own environment switches --------------------------------------------------------

# Dagster's own switches for a run over a range of partitions, set for this process's builds (and
# the step processes they start); docs/deployment.md sets them for a deployment's run workers.
# Neither has a setting in dagster.yaml or a public API.
BUILD_EVENT_SETTINGS = {
    # One "materialisation planned" event per asset instead of one per partition (half of a
    # chunk's events). The cost: partitions of a failed chunk show as missing rather than failed
    # in the UI, while the run itself shows the failure.
    "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS": "true",
    # A step's per-partition materialisations of one asset are written to the instance in one
    # batch (PostgreSQL: one connection and one insert per batch instead of per event; SQLite
    # storage writes them one by one either way).
    "DAGSTER_EVENT_BATCH_SIZE": "1000",
}


@contextmanager
def build_event_settings() -> Iterator[None]:
    """:data:`BUILD_EVENT_SETTINGS` in the environment for the duration (a value already set wins)."""
    before = {name: os.environ.get(name) for name in BUILD_EVENT_SETTINGS}
    for name, value in BUILD_EVENT_SETTINGS.items():
        os.environ[name] = before[name] or value
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


# ``dg check defs`` (Dagster's definitions validation command) sets this in the environment of the
# process that loads the definitions; nothing public says a load is a validation. Under it a user
# error is printed as one line (exit 2) instead of raised, which the UI needs to show it as the
# code location's load error.
DEFS_VALIDATION_ENV = "DAGSTER_IS_DEFS_VALIDATION_CLI"


def in_defs_validation() -> bool:
    """Whether the definitions are being loaded by ``dg check defs``."""
    return os.environ.get(DEFS_VALIDATION_ENV) == "1"


# ---- a beta API ----------------------------------------------------------------------------------


@contextmanager
def beta_api() -> Iterator[None]:
    """Dagster's beta warnings silenced for the duration. The TSDB's observable source asset has
    only a beta API (``multi_observable_source_asset``); Dagster notes it on every import of the
    module that uses it: in the webserver's log, and in each ``--workers`` build's step server,
    whose stderr is the user's terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        yield


# ---- a class named in instance configuration -----------------------------------------------------

# The compute logs of the instance a --workers build without DAGSTER_HOME runs in: a temporary
# instance on disk (multiprocess execution needs one), removed after the build, whose compute logs
# nobody reads. Dagster's default manager starts a `tail` and a Python orphan watcher per step
# process, and those print KeyboardInterrupt tracebacks of their own on Ctrl-C. Dagster exports
# no name for its no-op manager; instance configuration names a class by its module path, as
# dagster.yaml does (the repository's names LocalComputeLogManager the same way).
NO_COMPUTE_LOGS = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                    "class": "NoOpComputeLogManager"}}


def scratch_instance(directory: str) -> dg.DagsterInstance:
    """A temporary instance in ``directory`` that captures no compute logs."""
    return dg.DagsterInstance.local_temp(directory, overrides=NO_COMPUTE_LOGS)


# ---- instance methods without the public mark --------------------------------------------------


def materialized_partitions(instance: dg.DagsterInstance, key: dg.AssetKey) -> set[str]:
    """The partitions of ``key`` that ``instance`` has ever recorded as materialised, from the
    storage's partition index. The public ways cost more or say something else:
    ``fetch_materializations`` reads and decodes every materialisation event of the asset, and
    ``get_status_by_partition`` writes the asset's status cache and reports the latest attempt
    (a partition whose later run failed is FAILED, though its stored stages are recorded)."""
    return set(instance.get_materialized_partitions(key))


def step_end_times(instance: dg.DagsterInstance, run_id: str, step_key: str) -> list[float]:
    """Timestamps of the step's success or failure events in the run. The public event reads
    cover materialisations, observations and run status changes, not step events; Dagster's step
    statistics (``get_run_step_stats``) read and decode every materialisation of the run, plot and
    table included, to derive them."""
    ended = instance.get_records_for_run(
        run_id, of_type={dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE},
    ).records
    return [r.event_log_entry.timestamp for r in ended if r.event_log_entry.step_key == step_key]


def run_event_records(instance: dg.DagsterInstance, run_id: str,
                      of_type: set[dg.DagsterEventType] | None = None) -> list[Any]:
    """The event records of one run (of the given types), with their storage ids. The public
    reads (``fetch_materializations``, ``fetch_observations``) go by asset, not by run: deciding
    whether a run's every event is superseded would read every event of every asset it touched."""
    return list(instance.get_records_for_run(run_id, of_type=of_type).records)


def delete_run_files(instance: dg.DagsterInstance, run_id: str) -> None:
    """Remove what Dagster keeps of a deleted run beside its rows: its captured step logs, and on
    SQLite storage its own event-log file (empty once ``delete_run`` deleted its events, though as
    large on disk as they were). ``delete_run`` leaves both, and no public call removes them."""
    instance.compute_log_manager.delete_logs(prefix=[run_id])
    shard = getattr(instance.event_log_storage, "path_for_shard", None)  # SQLite's per-run files
    if shard is not None:
        Path(shard(run_id)).unlink(missing_ok=True)


# The table where Dagster's SQL event-log storages (SQLite, PostgreSQL) keep one row per check
# execution of a run, with the serialised evaluation event; its columns as Dagster names them.
CHECK_EXECUTIONS_TABLE = "asset_check_executions"


def delete_check_executions(instance: dg.DagsterInstance, run_id: str, checks: Iterable[dg.AssetCheckKey]) -> int:
    """Delete the rows of ``run_id``'s executions of ``checks`` from the instance's check table,
    except the latest row of each check (and partition); returns how many went. ``delete_run``
    deletes a run's events but leaves these rows (a copy of each evaluation event): every run that
    evaluated a check leaves one for ever, and no public call deletes them short of wiping the
    asset (``wipe_assets``, every check result of the asset). Storages without the table (not
    SQL) have nothing to delete."""
    storage = instance.event_log_storage
    if not hasattr(storage, "index_transaction") or not storage.has_table(CHECK_EXECUTIONS_TABLE):
        return 0
    latest = sa.text(f"SELECT max(id) FROM {CHECK_EXECUTIONS_TABLE} "
                     "WHERE asset_key = :asset_key AND check_name = :check_name GROUP BY partition")
    delete = sa.text(f"DELETE FROM {CHECK_EXECUTIONS_TABLE} WHERE asset_key = :asset_key AND "
                     "check_name = :check_name AND run_id = :run_id AND id NOT IN :latest"
                     ).bindparams(sa.bindparam("latest", expanding=True))
    deleted = 0
    with storage.index_transaction() as conn:
        for check in set(checks):
            where = {"asset_key": check.asset_key.to_string(), "check_name": check.name}
            keep = [row[0] for row in conn.execute(latest, where)]
            if keep:
                deleted += conn.execute(delete, {**where, "run_id": run_id, "latest": keep}).rowcount
    return deleted


def check_execution_runs(instance: dg.DagsterInstance, check: dg.AssetCheckKey) -> list[str]:
    """The runs of every execution of ``check`` the instance keeps, newest first (what the UI's
    check history lists). The public read (``get_latest_asset_check_evaluation_record``) gives
    only the latest."""
    return [r.run_id for r in instance.event_log_storage.get_asset_check_execution_history(check, limit=1_000_000)]


def report_run_failed(instance: dg.DagsterInstance, run: dg.DagsterRun, message: str) -> None:
    """Record ``run`` as failed with ``message``. A run whose executing process died stays
    "started" for ever otherwise; there is no public call that ends a run (run monitoring does it
    for a daemon's runs, not for runs executed in a build's own process), and deleting it
    (``delete_run``) would lose what it recorded."""
    instance.report_run_failed(run, message)


def add_partition_metadata(context: dg.AssetExecutionContext, key: dg.AssetKey, partition: str,
                           metadata: Mapping[str, Any]) -> None:
    """``metadata`` on the materialisation of ``key``'s ``partition`` that the step records, as the
    public ``context.add_asset_metadata(metadata, asset_key=key, partition_key=partition)`` puts
    it, without that call's check that ``partition`` is in the step's range: the check reads every
    partition of the run partitions definition from the instance, at each call (a query per run and
    stage that grows with the spec's runs). The step's partitions are the runs it built, so the
    check has nothing to find. The figures then ride in the step's batch of materialisations
    instead of an event each."""
    step = context.op_execution_context._step_execution_context
    step._metadata_accumulator = step._metadata_accumulator.with_additional_asset_metadata(
        asset_key=key, partition_key=partition, metadata=metadata,
    )


def instance_without_settings(instance: dg.DagsterInstance) -> dg.DagsterInstance:
    """The same storage as ``instance`` without its settings (telemetry, pool limits,
    ``python_logs``). Dagster configures Python logging from the instance's settings at every run
    start (``logging.config.dictConfig``), which deadlocks against another thread's run logging;
    the public constructors (``get``, ``ephemeral``, ``local_temp``) cannot open an instance's
    storage without its settings."""
    return dg.DagsterInstance.from_ref(instance.get_ref()._replace(settings={}))


__all__ = [
    "BUILD_EVENT_SETTINGS", "CHECK_EXECUTIONS_TABLE", "DEFS_VALIDATION_ENV", "add_partition_metadata", "beta_api",
    "build_event_settings", "check_execution_runs", "delete_check_executions", "delete_run_files",
    "in_defs_validation", "instance_without_settings", "materialized_partitions", "report_run_failed",
    "run_event_records", "step_end_times",
]
