"""The deployment's settings: chunk size, executor choice, Celery settings, the production
instance file and its initialisation script. Real components, no running cluster (see
``test_chunked_backfill.py`` and ``test_celery.py`` for those)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from aml_pipeline import config
from aml_pipeline.celery_config import executor_config
from aml_pipeline.components.assets import dataset_assets
from aml_pipeline.defs.executor import executor as executor_definitions
from aml_pipeline.components.partitions import run_backfill_policy
from aml_pipeline.demo import DEMO_SPEC
from aml_pipeline.errors import AmlError
from aml_pipeline.pipeline.registry import DATASET_ASSETS, RUN_ASSETS, StageVersions
from aml_pipeline.spec import load_spec
from aml_pipeline_tests.deploy.cluster import (
    DEPLOY,
    database,
    instance_env,
    production_home,
)

BIN = Path(sys.executable).parent
DEMO = load_spec(DEMO_SPEC)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("AML_EXECUTOR", "AML_CELERY_", "AML_BACKFILL_", "AML_RUN_PLOTS")):
            monkeypatch.delenv(name)


# ---- chunks ------------------------------------------------------------------------------------


def test_a_backfill_of_the_run_assets_is_one_run_per_range_and_the_sensor_chunks(monkeypatch) -> None:
    assert config.backfill_runs_per_chunk() == config.DEFAULT_BACKFILL_RUNS_PER_CHUNK == 50
    assert run_backfill_policy() == dg.BackfillPolicy.single_run()

    # The chunk size is the sensor's and the build's; a backfill (the UI's, `dg launch
    # --partition-range`) runs each contiguous range in one Dagster run whatever it is.
    monkeypatch.setenv("AML_BACKFILL_RUNS_PER_CHUNK", "7")
    assets = {k.path[-1]: a for a in dataset_assets(DEMO, StageVersions.of(DEMO)) for k in a.keys}
    for name in RUN_ASSETS:
        assert assets[name].backfill_policy == dg.BackfillPolicy.single_run(), name
    for name in DATASET_ASSETS:  # not partitioned
        assert assets[name].backfill_policy is None, name
    assert config.backfill_runs_per_chunk() == 7


@pytest.mark.parametrize("value", ["0", "-3", "ten", "2.5"])
def test_a_chunk_size_that_is_not_a_positive_whole_number_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv("AML_BACKFILL_RUNS_PER_CHUNK", value)
    with pytest.raises(AmlError) as err:
        config.backfill_runs_per_chunk()
    assert err.value.code == "CONFIG_INVALID"
    assert f"AML_BACKFILL_RUNS_PER_CHUNK={value!r}" in err.value.one_line()


# ---- run plots ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("on", True), ("OFF", False), (" off ", False)])
def test_run_plots_are_on_unless_switched_off(monkeypatch, value, on) -> None:
    if value is not None:
        monkeypatch.setenv("AML_RUN_PLOTS", value)
    assert config.run_plots() is on


@pytest.mark.parametrize("value", ["no", "0", "false", "sometimes"])
def test_a_run_plots_setting_other_than_on_or_off_fails_the_load_naming_it(monkeypatch, value) -> None:
    monkeypatch.setenv("AML_RUN_PLOTS", value)
    with pytest.raises(AmlError) as err:
        dataset_assets(DEMO, StageVersions.of(DEMO))
    assert err.value.code == "CONFIG_INVALID"
    assert f"AML_RUN_PLOTS={value.strip().lower()!r} must be on or off" in err.value.one_line()


# ---- executor ----------------------------------------------------------------------------------


def _asset_job_executor() -> dg.ExecutorDefinition:
    """The executor the loaded code location gives its asset jobs (backfill chunks included)."""
    from aml_pipeline.definitions import defs

    repo = defs().get_repository_def()
    return repo.get_job("__ASSET_JOB").executor_def


def test_without_a_setting_steps_run_on_dagsters_own_executor(monkeypatch) -> None:
    assert config.executor_name() == "multiprocess"
    assert executor_definitions().executor is None
    assert _asset_job_executor().name == "multi_or_in_process_executor"


def test_celery_executor_takes_its_urls_from_the_environment_at_run_time(monkeypatch) -> None:
    secret_url = "redis://worker:s3cret@127.0.0.1:6390/0"
    monkeypatch.setenv("AML_EXECUTOR", "celery")
    monkeypatch.setenv("AML_CELERY_BROKER_URL", secret_url)
    monkeypatch.setenv("AML_CELERY_VISIBILITY_TIMEOUT_S", "120")
    assert _asset_job_executor().name == "celery"

    cfg = executor_config()
    # References, resolved by the run worker; the URL (and its password) is in no definition.
    assert cfg["broker"] == {"env": "AML_CELERY_BROKER_URL"}
    assert cfg["backend"] == {"env": "AML_CELERY_BROKER_URL"}
    assert "s3cret" not in repr(cfg)
    settings = cfg["config_source"]
    assert settings["task_acks_late"] is True and settings["task_reject_on_worker_lost"] is True
    assert settings["worker_prefetch_multiplier"] == 1
    assert settings["broker_transport_options"]["visibility_timeout"] == 120

    monkeypatch.setenv("AML_CELERY_BACKEND_URL", "redis://127.0.0.1:6390/1")
    assert executor_config()["backend"] == {"env": "AML_CELERY_BACKEND_URL"}


@pytest.mark.parametrize(
    "env, named",
    [
        ({"AML_EXECUTOR": "celery"}, "AML_CELERY_BROKER_URL"),
        ({"AML_EXECUTOR": "kubernetes"}, "AML_EXECUTOR='kubernetes'"),
        ({"AML_EXECUTOR": "celery", "AML_CELERY_BROKER_URL": "redis://h/0", "AML_CELERY_VISIBILITY_TIMEOUT_S": "soon"},
         "AML_CELERY_VISIBILITY_TIMEOUT_S='soon'"),
    ],
)
def test_an_executor_setting_that_cannot_work_fails_the_load_naming_it(monkeypatch, env, named) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(AmlError) as err:
        executor_definitions()
    assert err.value.code == "CONFIG_INVALID" and named in err.value.one_line()


def test_workers_use_the_executors_celery_settings(monkeypatch) -> None:
    broker = "redis://127.0.0.1:6391/0"
    monkeypatch.setenv("AML_CELERY_BROKER_URL", broker)
    monkeypatch.setenv("AML_CELERY_VISIBILITY_TIMEOUT_S", "90")
    import aml_pipeline.workers as workers

    app = importlib.reload(workers).app
    assert app.conf.broker_url == broker and app.conf.result_backend == broker
    assert app.conf.task_acks_late is True and app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_transport_options["visibility_timeout"] == 90
    assert app.conf.task_default_queue == "dagster"
    assert "execute_plan" in app.tasks
    for key, value in executor_config()["config_source"].items():
        assert app.conf[key] == value, key


def test_dg_check_defs_passes_with_the_celery_executor(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    env.update(
        AML_EXECUTOR="celery", AML_CELERY_BROKER_URL="redis://127.0.0.1:6392/0", AML_HOME=str(tmp_path / "aml"),
        DAGSTER_HOME=str(tmp_path), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    check = subprocess.run(
        [str(BIN / "dg"), "check", "defs"], cwd=config.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert check.returncode == 0, check.stdout + check.stderr


# ---- the production instance -------------------------------------------------------------------


def test_the_production_instance_keeps_everything_in_postgresql(postgres_url, tmp_path, monkeypatch) -> None:
    settings = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    # Every connection setting is read from the environment: no host, user or password in the file.
    db = settings["storage"]["postgres"]["postgres_db"]
    for key in ("hostname", "port", "db_name", "username", "password"):
        assert set(db[key]) == {"env"}, (key, db[key])
    # The repository's own instance stays the embedded default.
    assert set(yaml.safe_load((config.REPO_ROOT / "dagster.yaml").read_text())["storage"]) == {"sqlite"}

    home = production_home(tmp_path)
    with database(postgres_url) as name:
        for k, v in instance_env(postgres_url, name, max_concurrent_runs=5).items():
            monkeypatch.setenv(k, v)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
            assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
            assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
            assert instance.run_coordinator.get_run_queue_config().max_concurrent_runs == 5
            assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
            assert instance.run_monitoring_enabled
            # Months of ticks: skipped and failed ones are purged, those that launched runs kept.
            for instigator in ("schedule", "sensor"):
                assert instance.get_settings("retention")[instigator]["purge_after_days"] == {"skipped": 7, "failure": 90}
            # It really stores: partitions added here are read back by a second instance.
            instance.add_dynamic_partitions("spec__runs", ["L1-0001", "L1-0002"])
        with dg.DagsterInstance.from_config(str(home)) as again:
            assert again.get_dynamic_partitions("spec__runs") == ["L1-0001", "L1-0002"]


def _init_instance(home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    full.update(env, DAGSTER_HOME=str(home), DAGSTER=str(BIN / "dagster"))
    return subprocess.run(
        ["bash", str(DEPLOY / "init-instance.sh")], env=full, capture_output=True, text=True, timeout=600
    )


def test_init_instance_stores_the_pool_limits(postgres_url, tmp_path, monkeypatch) -> None:
    home = production_home(tmp_path)
    refused = _init_instance(home, {"AML_TSDB_POOL_LIMIT": "many"})
    assert refused.returncode == 2 and "AML_TSDB_POOL_LIMIT=many" in refused.stderr, refused

    with database(postgres_url) as name:
        env = instance_env(postgres_url, name, max_concurrent_runs=4)

        for k, v in env.items():
            monkeypatch.setenv(k, v)

        def limits(extra: dict[str, str]) -> dict[str, int]:
            done = _init_instance(home, {**env, **extra})
            assert done.returncode == 0, done.stdout + done.stderr
            with dg.DagsterInstance.from_config(str(home)) as instance:
                storage = instance.event_log_storage
                return {k: storage.get_concurrency_info(k).slot_count for k in ("aml_tsdb", "aml_shared_env")}

        # A PostgreSQL TSDB serves several readers; the embedded file gets one (ingests need a gap).
        assert limits({"AML_TSDB_URL": "postgresql://aml@db/plant"}) == {"aml_tsdb": 4, "aml_shared_env": 1}
        assert limits({"AML_TSDB_URL": "duckdb:///srv/aml/tsdb.duckdb"}) == {"aml_tsdb": 1, "aml_shared_env": 1}
        assert limits({"AML_TSDB_URL": "postgresql://aml@db/plant", "AML_TSDB_POOL_LIMIT": "6"})["aml_tsdb"] == 6


# ---- the deployment's files --------------------------------------------------------------------


def _env_references(node) -> set[str]:
    """Names of the environment variables a Dagster YAML file reads (``{env: NAME}``)."""
    if isinstance(node, dict):
        if set(node) == {"env"}:
            return {node["env"]}
        return set().union(*(_env_references(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_env_references(v) for v in node)) if node else set()
    return set()


def test_the_example_environment_sets_every_variable_the_files_read_and_no_secret() -> None:
    assigned = {
        line.split("=", 1)[0]
        for line in (DEPLOY / "aml.env.example").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    }
    read = _env_references(yaml.safe_load((DEPLOY / "dagster.yaml").read_text()))
    read |= _env_references(yaml.safe_load((DEPLOY / "workspace.yaml").read_text()))
    secrets = {"DAGSTER_PG_PASSWORD", "PGPASSWORD"}
    assert read - secrets <= assigned, sorted(read - secrets - assigned)
    assert not assigned & secrets, sorted(assigned & secrets)
    assert "AML_TSDB_POOL_LIMIT" in assigned  # read by init-instance.sh
    # Read by Dagster's webserver and daemon: no upload of what --workers builds leave in logs/.
    assert "DAGSTER_DISABLE_TELEMETRY" in assigned
    # The Helm values talk to PostgreSQL the way deploy/dagster.yaml does.
    helm = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    scheme = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())["storage"]["postgres"]["postgres_db"]["scheme"]
    assert helm["postgresql"]["postgresqlScheme"] == scheme
    # ... and purge the same ticks (the chart spells out every status; -1 is Dagster's "keep").
    retention = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())["retention"]
    assert helm["retention"]["enabled"]
    for instigator in ("schedule", "sensor"):
        by_status = helm["retention"][instigator]["purgeAfterDays"]
        assert set(by_status) == {"skipped", "success", "failure", "started"}
        assert {k: v for k, v in by_status.items() if v != -1} == retention[instigator]["purge_after_days"]


def test_with_credentials_exports_each_systemd_credential(tmp_path) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "DAGSTER_PG_PASSWORD").write_text("s3cret word")
    (creds / "PGPASSWORD").write_text("other")
    script = DEPLOY / "systemd" / "with-credentials"
    env = {"PATH": os.environ["PATH"], "CREDENTIALS_DIRECTORY": str(creds)}
    shown = subprocess.run(
        [str(script), sys.executable, "-c", "import os; print(os.environ['DAGSTER_PG_PASSWORD'] + '|' + os.environ['PGPASSWORD'])"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert shown.returncode == 0 and shown.stdout.strip() == "s3cret word|other", shown

    (creds / "not-a-name").write_text("x")
    refused = subprocess.run([str(script), "true"], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not-a-name" in refused.stderr, refused


def test_a_worker_started_without_its_broker_says_so_in_one_line(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    started = subprocess.run(
        [str(BIN / "celery"), "-A", "aml_pipeline.workers", "worker"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert started.returncode != 0
    assert "Traceback" not in started.stderr, started.stderr
    assert started.stderr.strip().splitlines()[-1].startswith("CONFIG_INVALID: AML_CELERY_BROKER_URL is not set"), started.stderr
