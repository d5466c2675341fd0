"""gc prunes the Dagster instance: superseded runs of this project older than the retention go,
the latest materialisation of every partition (its figures, plot and checks) stays, as do runs
within the retention and runs of other jobs. On SQLite and on PostgreSQL instances, with builds
of a small spec, its edits, and a clock the test sets."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import psycopg
import pytest
import yaml

from aml_pipeline.components.dagster_internals import check_execution_runs
from aml_pipeline.components.maintenance import prune_instance
from aml_pipeline.components.schedules import runs_job_name
from aml_pipeline.pipeline.registry import DATASET_ASSETS, RUN_ASSETS
from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.dagster_server import DagsterDev, running
from aml_pipeline_tests.deploy.cluster import database, instance_env, production_home

# A busy 2-core machine loads the code location in several processes at once.
LOAD_TIMEOUT = 420

# What the UI asks for an asset's partitions and a partition's events (newest first).
UI_QUERY = """
query Retained($key: AssetKeyInput!, $partition: String!) {
  assetNodeOrError(assetKey: $key) {
    ... on AssetNode {
      assetPartitionStatuses { ... on DefaultPartitionStatuses { materializedPartitions } }
    }
  }
  assetOrError(assetKey: $key) {
    ... on Asset {
      assetEventHistory(partitions: [$partition], limit: 1000, eventTypeSelectors: [MATERIALIZATION, OBSERVATION]) {
        results {
          __typename
          ... on MaterializationEvent { runId metadataEntries { label } }
          ... on ObservationEvent { runId metadataEntries { label } }
        }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def tiny_plant(tmp_path_factory):
    plant = simulate_plant(n_runs=3, run_minutes=4, seed=7)
    url = f"duckdb://{tmp_path_factory.mktemp('retention_plant') / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    return plant, url


@contextlib.contextmanager
def _sqlite(tmp_path: Path) -> Iterator[tuple[dg.DagsterInstance, object]]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance, lambda: sum(p.stat().st_size for p in home.rglob("*") if p.is_file())


@contextlib.contextmanager
def _postgres(tmp_path: Path, server: str, monkeypatch) -> Iterator[tuple[dg.DagsterInstance, object]]:
    home = production_home(tmp_path)
    with database(server) as name:
        for k, v in instance_env(server, name, max_concurrent_runs=2).items():
            monkeypatch.setenv(k, v)

        def size() -> int:
            # What a deployment's autovacuum does between gcs: the deleted rows' space is reused.
            with psycopg.connect(server, dbname=name, autocommit=True) as con:
                con.execute("VACUUM")
                return con.execute("SELECT pg_database_size(current_database())").fetchone()[0]

        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield instance, size


@pytest.fixture(params=["sqlite", "postgres"])
def dagster_instance(request, tmp_path, monkeypatch):
    if request.param == "sqlite":
        with _sqlite(tmp_path) as pair:
            yield pair
    else:
        with _postgres(tmp_path, request.getfixturevalue("postgres_url"), monkeypatch) as pair:
            yield pair


def _edit(spec: DatasetSpec, i: int) -> DatasetSpec:
    """Every other build edits the spec (a new split seed: the dataset assets again, the runs not);
    every third rebuilds the runs from scratch."""
    j = spec.to_json_dict()
    return parse_spec({**j, "split": {**j["split"], "method": "hashed", "seed": i // 2}})


def _failing_run(instance: dg.DagsterInstance, job_name: str) -> str:
    @dg.op
    def boom():
        raise RuntimeError("the TSDB went away")

    def graph() -> None:
        boom()

    result = dg.job(name=job_name)(graph).execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    return result.run_id


def _foreign_run(instance: dg.DagsterInstance) -> str:
    @dg.op
    def note():
        yield dg.AssetMaterialization(asset_key="someone_elses_table")
        yield dg.Output(None)

    def graph() -> None:
        note()

    return dg.job(name="someone_elses_job")(graph).execute_in_process(instance=instance).run_id


def _ui(instance: dg.DagsterInstance, spec: DatasetSpec, tsdb_url: str, tmp_path: Path, runs: list[str]) -> dict:
    """``{(asset, partition): (materialised partitions, the partition's events newest first)}`` as
    the webserver (``dagster dev`` on the instance, the spec in its specs folder) shows them."""
    specs = tmp_path / "specs"
    specs.mkdir(exist_ok=True)
    (specs / f"{spec.id}.yaml").write_text(yaml.safe_dump(spec.to_json_dict(), sort_keys=False))
    env = {**os.environ, "DAGSTER_HOME": instance.root_directory, "AML_HOME": str(tmp_path / "aml"),
           "AML_TSDB_URL": tsdb_url, "AML_SPECS": str(specs), "AML_ENV_LOCATION": str(tmp_path / "aml" / "env"),
           "PYTHONUNBUFFERED": "1"}
    server = DagsterDev(module="aml_pipeline.definitions", env=env, cwd=tmp_path, log_path=tmp_path / "dagster-dev.log")
    out = {}
    with running(server):
        server.wait_for_graphql(LOAD_TIMEOUT)
        server.wait_for_location(LOAD_TIMEOUT)
        for name in RUN_ASSETS:
            for run_id in runs:
                data = server.graphql(UI_QUERY, {"key": {"path": [spec.id, name]}, "partition": run_id})
                statuses = data["assetNodeOrError"]["assetPartitionStatuses"]["materializedPartitions"]
                out[name, run_id] = (sorted(statuses), data["assetOrError"]["assetEventHistory"]["results"])
    return out


def _created(instance: dg.DagsterInstance, run_id: str) -> datetime:
    return instance.get_run_record_by_id(run_id).create_timestamp


def _next_stored_second(instance: dg.DagsterInstance) -> None:
    """Wait until a run created now is stored at least two seconds after the newest run so far.
    SQLite storage keeps a run's creation time to the second; without the wait, a fast machine
    creates the next run in the same (or the next) stored second as the builds before it, and a
    clock one second short of its retention cannot tell them apart."""
    newest = max(r.create_timestamp for r in instance.get_run_records())
    while datetime.now(timezone.utc) < newest + timedelta(seconds=2):
        time.sleep(0.05)


def test_gc_deletes_superseded_runs_and_keeps_every_partitions_latest(tiny_plant, dagster_instance, tmp_path):
    plant, tsdb_url = tiny_plant
    instance, size = dagster_instance
    spec = parse_spec(plant_spec_dict(plant, "ret_ds", history_steps=20, horizon_steps=10))
    runs = sorted(r.run_id for r in plant.runs if r.ended_at is not None)
    home = tmp_path / "aml"

    def week(first: int) -> None:
        for i in range(first, first + 2):
            materialize_dataset(_edit(spec, i), tsdb_url=tsdb_url, home=home, instance=instance,
                                console_log_level="CRITICAL", full=i % 3 == 0)

    foreign = _foreign_run(instance)
    week(0)
    _next_stored_second(instance)
    failed = _failing_run(instance, runs_job_name(spec.id))
    week(2)
    everything = {r.run_id for r in instance.get_runs()}
    latest_before = {
        key: instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION)
        for key in (dg.AssetKey([spec.id, n]) for n in RUN_ASSETS)
    }
    manifest_before = instance.get_latest_materialization_event(dg.AssetKey([spec.id, "dataset_manifest"]))

    # 30 days after the failed run, less a second: it is within the retention, the builds before it are not.
    now = _created(instance, failed) + timedelta(days=30) - timedelta(seconds=1)
    dry = prune_instance(instance, [spec.id], retention_days=30, now=now, dry_run=True)
    assert dry.deleted_runs and dry.freed_bytes > 0
    assert {r.run_id for r in instance.get_runs()} == everything  # nothing deleted
    report = prune_instance(instance, [spec.id], retention_days=30, now=now)
    assert sorted(report.deleted_runs) == sorted(dry.deleted_runs)
    left = {r.run_id for r in instance.get_runs()}
    assert foreign in left and failed in left
    assert set(report.deleted_runs) == everything - left

    # Every partition still materialised, with the same latest event, figures and plot.
    for key, latest in latest_before.items():
        assert instance.get_materialized_partitions(key) == set(runs)
        assert instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION) == latest
        # each run's figures (and the windows' plot) are the metadata of that latest materialisation
        for run_id in runs:
            [record] = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=key, asset_partitions=[run_id]), limit=1).records
            assert record.storage_id == latest[run_id] and record.asset_materialization.metadata, (key, run_id)
    for name in DATASET_ASSETS:
        assert instance.get_latest_materialization_event(dg.AssetKey([spec.id, name])) is not None, name
    assert instance.get_latest_materialization_event(
        dg.AssetKey([spec.id, "dataset_manifest"])).run_id == manifest_before.run_id
    check = instance.get_latest_asset_check_evaluation_record(
        dg.AssetCheckKey(dg.AssetKey([spec.id, "dataset_manifest"]), "hash_verifies"))
    assert check is not None and check.run_id == manifest_before.run_id

    # Week by week: the same builds, then gc a retention later: the instance does not grow.
    week_one = size()
    week(4)
    far = datetime.now(timezone.utc) + timedelta(days=31)
    prune_instance(instance, [spec.id], retention_days=30, now=far)
    week_two = size()
    week(6)
    prune_instance(instance, [spec.id], retention_days=30, now=far + timedelta(days=1))
    week_three = size()
    assert week_three <= 1.1 * week_two, (week_one, week_two, week_three)
    assert foreign in {r.run_id for r in instance.get_runs()}

    # The UI shows every partition materialised, its newest events those of the latest build.
    shown = _ui(instance, _edit(spec, 7), tsdb_url, tmp_path, runs)
    for (name, run_id), (materialised, events) in shown.items():
        key = dg.AssetKey([spec.id, name])
        assert materialised == runs, (name, materialised)
        newest = {e["__typename"]: e for e in reversed(events)}  # the first of each type wins
        latest_mat = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[run_id]), limit=1).records[0]
        assert newest["MaterializationEvent"]["runId"] == latest_mat.run_id
        labels = {m["label"] for m in newest["MaterializationEvent"]["metadataEntries"]}
        assert labels and labels == set(latest_mat.asset_materialization.metadata), (name, labels)
        # only the runs within the retention (and the latest) left: not a month of rebuilds
        assert len(events) <= 2 * 4, (name, run_id, len(events))


def test_gc_deletes_the_check_results_of_the_runs_it_deletes(tmp_path):
    """Dagster's ``delete_run`` leaves a run's check executions (a copy of each evaluation); gc
    deletes those of the runs it deletes, and the latest of each check stays with its run."""
    checks = [dg.AssetCheckSpec(n, asset=dg.AssetKey(["tiny", "checked"])) for n in ("first", "second")]

    @dg.asset(key=["tiny", "checked"], check_specs=checks)
    def checked():
        return dg.MaterializeResult(check_results=[dg.AssetCheckResult(check_name=c.name, passed=True) for c in checks])

    job = dg.Definitions(assets=[checked], jobs=[dg.define_asset_job(runs_job_name("tiny"))]).resolve_job_def(
        runs_job_name("tiny"))
    with _sqlite(tmp_path) as (instance, _):
        runs = [job.execute_in_process(instance=instance).run_id for _ in range(3)]
        keys = [c.key for c in checks]
        assert all(check_execution_runs(instance, k) == runs[::-1] for k in keys)
        far = datetime.now(timezone.utc) + timedelta(days=2)
        dry = prune_instance(instance, ["tiny"], retention_days=1, now=far, dry_run=True)
        assert all(check_execution_runs(instance, k) == runs[::-1] for k in keys)
        report = prune_instance(instance, ["tiny"], retention_days=1, now=far)
        assert sorted(report.deleted_runs) == sorted(dry.deleted_runs) == sorted(runs[:2])
        assert report.freed_bytes == dry.freed_bytes > 0
        assert all(check_execution_runs(instance, k) == [runs[2]] for k in keys)
        assert all(instance.get_latest_asset_check_evaluation_record(k).run_id == runs[2] for k in keys)
