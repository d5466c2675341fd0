"""What the package relies on beyond Dagster's public API, each item checked against the
installed Dagster (:mod:`aml_pipeline.components.dagster_internals`): a Dagster upgrade that
changes one of them fails here, not in a build."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

import aml_pipeline
from aml_pipeline.components import dagster_internals as internals

DAGSTER_SOURCE = Path(dg.__file__).parent
REPO = Path(aml_pipeline.__file__).parent.parent


def _dagster_reads(name: str) -> list[str]:
    """The files of the installed Dagster (and its ``dg`` CLI) that read or set ``name``."""
    roots = [DAGSTER_SOURCE, *(p for p in DAGSTER_SOURCE.parent.glob("dagster_dg_cli") if p.is_dir())]
    return [str(f) for root in roots for f in root.rglob("*.py") if name in f.read_text(encoding="utf-8")]


def _job(tmp: str = "x") -> dg.JobDefinition:
    part = dg.StaticPartitionsDefinition(["a", "b"])

    @dg.asset(name=f"thing_{tmp}", partitions_def=part)
    def thing() -> None:
        return None

    return dg.Definitions(assets=[thing]).resolve_implicit_global_asset_job_def()


# ---- no private imports anywhere -----------------------------------------------------------------


def test_no_module_imports_dagsters_private_packages() -> None:
    private = re.compile(r"^\s*(from\s+dagster\w*\._|import\s+dagster\w*\._)", re.M)
    offenders = [
        str(f.relative_to(REPO))
        for folder in ("aml_pipeline", "aml_pipeline_tests", "bench", "deploy")
        for f in (REPO / folder).rglob("*.py")
        if private.search(f.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_the_non_public_calls_are_only_in_the_internals_module() -> None:
    calls = re.compile(r"\.(get_runs|report_run_failed|get_materialized_partitions|get_records_for_run|delete_logs|"
                       r"path_for_shard|index_transaction|get_asset_check_execution_history)\b|asset_check_executions|"
                       r"_replace\(settings|BetaWarning|DAGSTER_IS_DEFS_VALIDATION_CLI\"|\"DAGSTER_EVENT_BATCH_SIZE|"
                       r"\"DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS")
    offenders = [
        str(f.relative_to(REPO)) for f in (REPO / "aml_pipeline").rglob("*.py")
        if f.name != "dagster_internals.py" and calls.search(f.read_text(encoding="utf-8"))
    ]
    assert offenders == []


# ---- the environment switches --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(internals.BUILD_EVENT_SETTINGS))
def test_dagster_still_reads_each_event_switch(name: str) -> None:
    assert any(f'os.getenv("{name}"' in Path(f).read_text(encoding="utf-8") for f in _dagster_reads(name)), name


def test_the_event_switches_are_set_for_the_duration_and_a_set_value_wins(monkeypatch) -> None:
    for name in internals.BUILD_EVENT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DAGSTER_EVENT_BATCH_SIZE", "7")
    with internals.build_event_settings():
        assert os.environ["DAGSTER_EVENT_BATCH_SIZE"] == "7"
        assert os.environ["DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS"] == "true"
    assert "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS" not in os.environ
    assert os.environ["DAGSTER_EVENT_BATCH_SIZE"] == "7"


def test_dg_check_defs_still_sets_the_validation_switch(monkeypatch) -> None:
    setters = [f for f in _dagster_reads(internals.DEFS_VALIDATION_ENV)
               if re.search(rf"{internals.DEFS_VALIDATION_ENV}\W+\s*[:=,]\s*\W*1", Path(f).read_text(encoding="utf-8"))]
    assert setters, f"no Dagster module sets {internals.DEFS_VALIDATION_ENV}=1"
    monkeypatch.setenv(internals.DEFS_VALIDATION_ENV, "1")
    assert internals.in_defs_validation()
    monkeypatch.delenv(internals.DEFS_VALIDATION_ENV)
    assert not internals.in_defs_validation()


# ---- the beta API --------------------------------------------------------------------------------


def _observable_source() -> None:
    @dg.multi_observable_source_asset(specs=[dg.AssetSpec("beta_probe")])
    def probe() -> None:
        return None


def test_the_source_asset_api_is_still_beta_and_its_warning_is_silenced() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _observable_source()
    # Once it is no longer beta, beta_api and its use in components/sources.py go.
    assert any(issubclass(w.category, dg.BetaWarning) for w in seen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with internals.beta_api():
            _observable_source()
    assert not any(issubclass(w.category, dg.BetaWarning) for w in seen)


# ---- the instance methods ------------------------------------------------------------------------


def _params(method) -> list[str]:
    return list(inspect.signature(method).parameters)


def test_materialized_partitions_reads_what_the_instance_recorded() -> None:
    assert _params(dg.DagsterInstance.get_materialized_partitions)[:2] == ["self", "asset_key"]
    with dg.instance_for_test() as instance:
        key = dg.AssetKey(["probe"])
        assert internals.materialized_partitions(instance, key) == set()
        for p in ("r1", "r2", "r1"):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key, partition=p))
        assert internals.materialized_partitions(instance, key) == {"r1", "r2"}


def test_step_end_times_are_the_steps_end_events() -> None:
    params = _params(dg.DagsterInstance.get_records_for_run)
    assert params[:2] == ["self", "run_id"] and "of_type" in params
    with dg.instance_for_test() as instance:
        result = _job("steps").execute_in_process(instance=instance, partition_key="a")
        [step] = [e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_SUCCESS]
        [stats] = instance.get_run_step_stats(result.run_id, step_keys=[step])
        assert internals.step_end_times(instance, result.run_id, step) == [stats.end_time]
        assert internals.step_end_times(instance, result.run_id, "no_such_step") == []


def test_report_run_failed_ends_a_started_run_with_the_message() -> None:
    params = _params(dg.DagsterInstance.report_run_failed)
    assert params[:3] == ["self", "dagster_run", "message"]
    with dg.instance_for_test() as instance:
        run2 = instance.create_run_for_job(_job("failed"), run_config={}, tags={"dagster/partition": "a"})
        internals.report_run_failed(instance, run2, "the build ended")
        record = instance.get_run_record_by_id(run2.run_id)
        assert record.dagster_run.status == dg.DagsterRunStatus.FAILURE
        messages = [r.event_log_entry.dagster_event.message
                    for r in instance.fetch_run_status_changes(dg.DagsterEventType.RUN_FAILURE, limit=10).records
                    if r.event_log_entry.run_id == run2.run_id]
        assert messages == ["the build ended"]


def test_instance_without_settings_shares_the_storage_not_the_settings(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        assert "settings" in instance.get_ref()._fields
        assert instance.get_settings("telemetry") == {"enabled": False}
        quiet = internals.instance_without_settings(instance)
        try:
            assert quiet.get_settings("telemetry") == {}
            assert quiet.get_ref()._replace(settings=None) == instance.get_ref()._replace(settings=None)
            key = dg.AssetKey(["shared"])
            quiet.report_runless_asset_event(dg.AssetMaterialization(asset_key=key, partition="r1"))
            assert internals.materialized_partitions(instance, key) == {"r1"}
        finally:
            quiet.dispose()
    finally:
        instance.dispose()


def test_partition_metadata_lands_on_each_partitions_materialisation() -> None:
    runs = dg.DynamicPartitionsDefinition(name="probe_runs")
    specs = [dg.AssetSpec(n, partitions_def=runs) for n in ("first", "second")]

    @dg.multi_asset(specs=specs, backfill_policy=dg.BackfillPolicy.single_run())
    def step(context):  # noqa: ANN001 - Dagster passes the asset context
        for key in context.partition_keys:
            for spec in specs:
                internals.add_partition_metadata(context, spec.key, key, {"run": key, "asset": spec.key.path[-1]})
        for spec in specs:
            yield dg.MaterializeResult(asset_key=spec.key)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("probe_runs", ["r1", "r2", "r3"])
        result = dg.materialize([step], instance=instance, tags={
            "dagster/asset_partition_range_start": "r1", "dagster/asset_partition_range_end": "r2"})
        assert result.success
        for spec in specs:
            for key in ("r1", "r2"):
                [record] = instance.fetch_materializations(
                    dg.AssetRecordsFilter(asset_key=spec.key, asset_partitions=[key]), limit=1).records
                metadata = record.asset_materialization.metadata
                assert (metadata["run"].value, metadata["asset"].value) == (key, spec.key.path[-1])
            assert not instance.fetch_observations(spec.key, limit=1).records
        assert internals.materialized_partitions(instance, specs[0].key) == {"r1", "r2"}


def test_run_event_records_are_the_runs_events_of_the_asked_types() -> None:
    params = _params(dg.DagsterInstance.get_records_for_run)
    assert params[:2] == ["self", "run_id"] and "of_type" in params
    with dg.instance_for_test() as instance:
        result = _job("events").execute_in_process(instance=instance, partition_key="a")
        every = internals.run_event_records(instance, result.run_id)
        assert {r.event_log_entry.run_id for r in every} == {result.run_id}
        assert [r.storage_id for r in every] == sorted(r.storage_id for r in every)
        [done] = internals.run_event_records(instance, result.run_id, {dg.DagsterEventType.RUN_SUCCESS})
        assert done.event_log_entry.dagster_event.event_type == dg.DagsterEventType.RUN_SUCCESS


def test_delete_run_files_removes_the_step_logs_and_the_sqlite_run_file(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        result = _job("files").execute_in_process(instance=instance, partition_key="a")
        run_id = result.run_id
        shard = Path(instance.event_log_storage.path_for_shard(run_id))
        logs = [p for p in (tmp_path / "storage").rglob("*") if p.is_file() and run_id in str(p) and p != shard]
        assert shard.exists() and logs, "Dagster no longer writes a run's shard or step logs where expected"
        instance.delete_run(run_id)
        assert shard.exists() and any(p.exists() for p in logs), "delete_run now removes the files itself"
        internals.delete_run_files(instance, run_id)
        assert not shard.exists() and not any(p.exists() for p in logs)
    finally:
        instance.dispose()


def _checked_job(name: str) -> dg.JobDefinition:
    """An asset with two checks, each run evaluating both."""
    checks = [dg.AssetCheckSpec(n, asset="checked") for n in ("first", "second")]

    @dg.asset(name="checked", check_specs=checks)
    def checked():
        return dg.MaterializeResult(check_results=[dg.AssetCheckResult(check_name=c.name, passed=True) for c in checks])

    return dg.Definitions(assets=[checked], jobs=[dg.define_asset_job(name)]).resolve_job_def(name)


@contextlib.contextmanager
def _instance(storage: str, tmp_path: Path, request, monkeypatch) -> Iterator[dg.DagsterInstance]:
    """A persistent instance: SQLite files, or deploy/dagster.yaml's PostgreSQL storage on a fresh database."""
    if storage == "sqlite":
        (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
            yield instance
        return
    from aml_pipeline_tests.deploy.cluster import database, instance_env, production_home

    server = request.getfixturevalue("postgres_url")
    with database(server) as name:
        for k, v in instance_env(server, name, max_concurrent_runs=1).items():
            monkeypatch.setenv(k, v)
        with dg.DagsterInstance.from_config(str(production_home(tmp_path))) as instance:
            yield instance


@pytest.mark.parametrize("storage", ["sqlite", "postgres"])
def test_delete_check_executions_deletes_a_deleted_runs_rows_never_a_checks_latest(storage, tmp_path, request,
                                                                                    monkeypatch) -> None:
    with _instance(storage, tmp_path, request, monkeypatch) as instance:
        params = _params(type(instance.event_log_storage).get_asset_check_execution_history)
        assert params[:3] == ["self", "check_key", "limit"]
        assert instance.event_log_storage.has_table(internals.CHECK_EXECUTIONS_TABLE)
        job = _checked_job("checked_job")
        runs = [job.execute_in_process(instance=instance).run_id for _ in range(3)]
        keys = [dg.AssetCheckKey(dg.AssetKey("checked"), n) for n in ("first", "second")]
        assert all(internals.check_execution_runs(instance, k) == runs[::-1] for k in keys)
        instance.delete_run(runs[0])
        # Dagster keeps a deleted run's check executions: once it deletes them itself, this goes.
        assert all(internals.check_execution_runs(instance, k) == runs[::-1] for k in keys)
        assert internals.delete_check_executions(instance, runs[0], keys) == 2
        assert all(internals.check_execution_runs(instance, k) == runs[:0:-1] for k in keys)
        # the latest execution of a check stays, even asked for by its run
        assert internals.delete_check_executions(instance, runs[2], keys) == 0
        assert internals.delete_check_executions(instance, runs[1], keys[:1]) == 1
        assert internals.check_execution_runs(instance, keys[0]) == [runs[2]]
        assert internals.check_execution_runs(instance, keys[1]) == runs[:0:-1]
        assert instance.get_latest_asset_check_evaluation_record(keys[0]).run_id == runs[2]


# ---- a class named in instance configuration -----------------------------------------------------


def test_the_scratch_instance_captures_no_compute_logs(tmp_path, monkeypatch) -> None:
    """The class the configuration names still exists there and still captures nothing: a step's
    output is neither written to a file nor tailed by a helper process."""
    import subprocess

    started: list[object] = []
    real = subprocess.Popen.__init__

    def record(self, args, *a, **kw):  # noqa: ANN001 - Popen's own signature
        started.append(args)
        real(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    with internals.scratch_instance(str(tmp_path)) as instance:
        manager = instance.compute_log_manager
        assert type(manager).__name__ == "NoOpComputeLogManager"
        with manager.capture_logs(["run", "step"]):
            print("a step's output")
    assert started == []
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".out", ".err", ".complete")]
