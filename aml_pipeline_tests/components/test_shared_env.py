"""The ``rebuild_shared_env`` job and ``SharedEnvResource``, executed by Dagster for real."""

import os
import platform
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from aml_pipeline.components.resources import plant_resources
from aml_pipeline.components.shared_env import (
    REBUILD_JOB,
    SHARED_ENV_KEY,
    SHARED_ENV_POOL,
    SharedEnvResource,
    busy_failure,
    rebuild_shared_env_job,
    shared_env_asset,
)
from aml_pipeline.envs import current_env, use_shared_env
from aml_pipeline.lease import EnvBusy
from aml_pipeline_tests.envs.support import (
    REPO_ROOT,
    LeaseHolder,
    env_settings,
    materialization,
    shared_env_resource,
    step_failures,
)


def _run_rebuild(settings, instance, **resource_kw) -> dg.ExecuteInProcessResult:
    defs = dg.Definitions(
        assets=[shared_env_asset],
        jobs=[rebuild_shared_env_job],
        resources={"shared_env": shared_env_resource(settings, **resource_kw)},
    )
    return defs.resolve_job_def(REBUILD_JOB).execute_in_process(instance=instance, raise_on_error=False)


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def test_rebuild_job_builds_and_reports_interpreter_version_and_packages(tmp_path, instance):
    settings = env_settings(tmp_path)
    result = _run_rebuild(settings, instance)
    assert result.success, step_failures(result)
    meta = materialization(result, SHARED_ENV_KEY)
    state = current_env(settings.venv_path)
    assert meta["python"] == str(state.python) and Path(meta["python"]).exists()
    assert meta["python_version"] == f"{platform.python_implementation()} {platform.python_version()}"
    packages = {row["package"]: row["version"] for row in meta["packages"]}
    assert packages["numpy"] == "2.4.6" and packages["dagster-pipes"] == "1.13.27"
    assert meta["package_count"] == len(packages) and meta["installer"] == "copy"
    assert meta["venv_path"] == str(settings.venv_path) and meta["lease_holder"].startswith("rebuild_shared_env (run ")
    first_version = instance.get_latest_materialization_event(SHARED_ENV_KEY).asset_materialization.tags[
        "dagster/data_version"
    ]

    # A second rebuild swaps a new build in and removes the old one; same packages, same version.
    again = _run_rebuild(settings, instance)
    assert again.success, step_failures(again)
    meta2 = materialization(again, SHARED_ENV_KEY)
    assert meta2["build_dir"] != meta["build_dir"] and meta2["replaced"] == meta["build_dir"]
    assert not Path(meta["build_dir"]).exists() and os.readlink(settings.venv_path) == Path(meta2["build_dir"]).name
    second_version = instance.get_latest_materialization_event(SHARED_ENV_KEY).asset_materialization.tags[
        "dagster/data_version"
    ]
    assert second_version == first_version


def test_rebuild_job_fails_with_env_busy_naming_the_readers(tmp_path, instance):
    settings = env_settings(tmp_path)
    assert _run_rebuild(settings, instance).success
    before = os.readlink(settings.venv_path)
    with LeaseHolder(settings, "evaluation job 42") as reader, LeaseHolder(settings, "notebook of ana"):
        result = _run_rebuild(settings, instance)
        assert not result.success
        [failure] = step_failures(result)
        assert "ENV_BUSY" in failure and "evaluation job 42" in failure and "notebook of ana" in failure
        assert "2 readers hold leases" in failure
        event = next(e for e in result.all_events if e.is_step_failure)
        meta = event.step_failure_data.user_failure_data.metadata
        assert meta["readers"].value == 2 and "evaluation job 42" in meta["holders"].value
        assert reader.proc.poll() is None  # the reader was not disturbed
    assert os.readlink(settings.venv_path) == before  # nothing was rebuilt
    assert _run_rebuild(settings, instance).success  # and it works once they are gone


def test_rebuild_job_with_a_wait_is_not_starved_by_readers(tmp_path, instance):
    # While the job waits for the exclusive lease, a new reader is refused naming it; once the
    # reader that held the lease is done, the job gets it and rebuilds.
    settings = env_settings(tmp_path)
    reader = LeaseHolder(settings, "evaluation job 42")
    seen: dict = {}

    def while_the_job_waits() -> None:
        try:
            lease = settings.open_lease()
            deadline = time.monotonic() + 120
            while (status := lease.status()).waiting is None and time.monotonic() < deadline:
                time.sleep(0.02)
            seen["status"] = status
            try:
                with use_shared_env(settings, holder="late evaluation"):
                    seen["admitted"] = True
            except EnvBusy as e:
                seen["refused"] = e
        finally:
            reader.release()

    helper = threading.Thread(target=while_the_job_waits)
    helper.start()
    try:
        result = _run_rebuild(settings, instance, rebuild_wait_s=120)
    finally:
        helper.join(timeout=300)
        reader.close()
    assert result.success, step_failures(result)
    waiting = seen["status"].waiting
    assert waiting is not None and waiting.holder.startswith("rebuild_shared_env (run ")
    assert seen["status"].holders == ["evaluation job 42"] and "admitted" not in seen
    refused = seen["refused"]
    assert f"a rebuild is waiting for the exclusive lock: {waiting.holder}" in refused.message
    meta = busy_failure(refused, "cannot train").metadata
    assert meta["waiting_rebuild"].value == waiting.describe() and meta["holders"].value == "evaluation job 42"
    assert current_env(settings.venv_path).exists


def test_rebuild_runs_in_a_pool_limited_to_one(tmp_path):
    assert shared_env_asset.op.pool == SHARED_ENV_POOL == "aml_shared_env"
    conf = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    assert conf["concurrency"]["pools"]["default_limit"] == 1


def test_default_resources_read_the_lease_location_through_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AML_ENV_LOCATION", raising=False)
    res = plant_resources()["shared_env"]
    assert res.lease_location == str(tmp_path / "home" / "env")
    assert res.venv_path == str(tmp_path / "home" / "shared-env" / "venv")
    monkeypatch.setenv("AML_ENV_LOCATION", str(tmp_path / "locks"))
    res = plant_resources()["shared_env"]
    assert isinstance(res.lease_location, dg.EnvVar) and res.lease_location.env_var_name == "AML_ENV_LOCATION"
    with dg.build_resources({"shared_env": res}) as built:  # resolved when Dagster initialises it
        assert built.shared_env.settings().lease_location == str(tmp_path / "locks")
    assert isinstance(plant_resources()["pipes_subprocess_client"], dg.PipesSubprocessClient)


def test_resource_refuses_an_unknown_installer(tmp_path):
    from aml_pipeline.errors import AmlError

    with pytest.raises(AmlError, match="installer 'conda'"):
        SharedEnvResource(lease_location=str(tmp_path / "l"), venv_path=str(tmp_path / "v"), installer="conda").settings()


def test_code_location_has_the_job_the_asset_and_the_baselines():
    from aml_pipeline.definitions import defs

    d = defs()
    job = d.resolve_job_def(REBUILD_JOB)
    assert job.asset_layer.selected_asset_keys == {SHARED_ENV_KEY}
    graph = d.resolve_asset_graph()
    baseline = dg.AssetKey(["reactor_a", "baseline_model"])
    assert graph.get(baseline).parent_keys == {dg.AssetKey(["reactor_a", "dataset_manifest"]), SHARED_ENV_KEY}
    assert graph.get(baseline).group_name == "reactor_a"


def test_failed_rebuild_fails_the_step_and_keeps_the_environment(tmp_path, instance):
    settings = env_settings(tmp_path)
    assert _run_rebuild(settings, instance).success
    before = os.readlink(settings.venv_path)
    broken = settings.__class__(**{**settings.__dict__, "check_imports": ("no_such_module_anywhere",)})
    result = _run_rebuild(broken, instance)
    [failure] = step_failures(result)
    assert "ENV_BUILD_FAILED" in failure and "no_such_module_anywhere" in failure
    assert os.readlink(settings.venv_path) == before
