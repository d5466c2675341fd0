"""``[reactor_a, baseline_model]``: training in the shared environment, under a read lease.

Everything is real: the simulated plant is built into a snapshot through Dagster, the shared
environment is a venv built by the rebuild code (copy installer, offline), and the training
script runs under that venv's interpreter through ``dg.PipesSubprocessClient``.
"""

import json
import shutil
import threading
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.components.baseline import baseline_assets
from aml_pipeline.components.resources import StoreResource
from aml_pipeline.demo import DEMO_SPEC
from aml_pipeline.envs import rebuild_shared_env, shared_env_status
from aml_pipeline.lease import EnvBusy
from aml_pipeline.spec import load_spec
from aml_pipeline.training.ridge_baseline import HOLD_ENV, HOLD_MAX_ENV
from aml_pipeline_tests.envs.support import (
    LeaseHolder,
    built_env,
    demo_dataset,
    env_settings,
    materialization,
    run_cli,
    shared_env_resource,
    step_failures,
)

SPEC = load_spec(DEMO_SPEC)
KEY = dg.AssetKey([SPEC.id, "baseline_model"])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return built_env(tmp_path_factory)


def _materialize(settings, home: Path, datasets_dir: Path | None = None) -> dg.ExecuteInProcessResult:
    resources = {
        "shared_env": shared_env_resource(settings),
        "store": StoreResource(home=str(home), datasets_dir=str(datasets_dir) if datasets_dir else None),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }
    with dg.DagsterInstance.ephemeral() as instance:
        return dg.materialize(baseline_assets(SPEC), instance=instance, resources=resources, raise_on_error=False)


def test_baseline_beats_persistence_on_test_in_model_units(demo, env):
    result = _materialize(env, demo.home)
    assert result.success, step_failures(result)
    meta = materialization(result, KEY)
    rows = {r["target"]: r for r in meta["rmse"]}
    assert set(rows) == {"TI101", "QI301"}
    assert rows["TI101"]["unit"] == "K" and rows["QI301"]["unit"] == "%"
    for target, r in rows.items():
        print(
            f"{target} [{r['unit']}]: val RMSE model {r['val_rmse_model']:.4f} vs persistence "
            f"{r['val_rmse_persistence']:.4f}; test RMSE model {r['test_rmse_model']:.4f} vs persistence "
            f"{r['test_rmse_persistence']:.4f}"
        )
        # Holds per target on the simulated plant, whose targets follow its controls.
        assert r["test_rmse_model"] < r["test_rmse_persistence"], target
        assert r["val_rmse_model"] < r["val_rmse_persistence"], target
        assert meta[f"test_rmse_model/{target}"] == r["test_rmse_model"]
    assert meta["test_beats_persistence_all_targets"] is True
    assert meta["hash_verified"] is True and meta["snapshot_sha256"] == demo.summary["sha256"]
    assert meta["catalog_sha256"] == demo.summary["sha256"]
    assert meta["windows_train"] == demo.summary["windows"]["train"] and meta["features"] == 60 * 6 + 30 * 2
    assert meta["alpha"] in (1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)
    # It ran under the shared environment's interpreter, not the project's.
    assert meta["python"].startswith(str(env.venv_path.parent)) and meta["numpy_version"] == "2.4.6"
    assert meta["shared_env_python"].startswith(str(env.venv_path.parent))
    assert Path(meta["model_path"]).exists()
    assert meta["read_lease_holder"].startswith("reactor_a/baseline_model (run ")
    assert shared_env_status(env, probe=False)["idle"]  # the read lease ended with the step


def test_baseline_holds_a_read_lease_for_the_whole_training(demo, env, tmp_path, monkeypatch):
    """The script waits at a hold point (test hook) while the test looks at the lease from
    outside: the asset's reader is listed, a rebuild (in-process and from the CLI, another
    process) is refused with ENV_BUSY naming it; released, training completes."""
    go = tmp_path / "go"
    monkeypatch.setenv(HOLD_ENV, str(go))
    monkeypatch.setenv(HOLD_MAX_ENV, "120")
    seen: dict = {}

    def observe() -> None:
        try:
            waiting = Path(str(go) + ".waiting")
            for _ in range(1200):
                if waiting.exists():
                    break
                threading.Event().wait(0.05)
            status = shared_env_status(env, probe=False)
            seen["holders"] = status["lease"]["holders"]
            seen["script_pid"] = int(waiting.read_text())
            try:
                rebuild_shared_env(env, holder="impatient rebuild")
            except EnvBusy as e:
                seen["in_process"] = e.one_line()
            cli = run_cli("env", "rebuild", "--installer", "copy", "--location", env.lease_location, "--venv", str(env.venv_path))
            seen["cli"] = (cli.returncode, cli.stderr)
        finally:
            go.write_text("go")

    observer = threading.Thread(target=observe)
    observer.start()
    result = _materialize(env, demo.home)
    observer.join(timeout=180)
    assert result.success, step_failures(result)
    assert len(seen["holders"]) == 1 and seen["holders"][0].startswith("reactor_a/baseline_model (run ")
    assert seen["in_process"].startswith("ENV_BUSY: ") and "reactor_a/baseline_model" in seen["in_process"]
    code, stderr = seen["cli"]
    assert code == 2 and stderr.startswith("ENV_BUSY: ") and "reactor_a/baseline_model" in stderr
    assert shared_env_status(env, probe=False)["idle"]


def test_tampered_snapshot_is_refused_naming_the_file(demo, env, tmp_path):
    copy = tmp_path / "datasets"
    shutil.copytree(demo.datasets_root, copy, symlinks=True)
    y = copy / SPEC.id / "current" / "arrays" / "y.f32"
    data = bytearray(y.read_bytes())
    data[len(data) // 3] ^= 0x40
    y.write_bytes(bytes(data))
    result = _materialize(env, tmp_path / "home", datasets_dir=copy)
    assert not result.success
    [failure] = step_failures(result)
    assert "SNAPSHOT_TAMPERED" in failure and "hash mismatch" in failure and "arrays/y.f32" in failure
    assert demo.summary["sha256"] in failure  # the recorded hash it failed against
    assert not (tmp_path / "home" / "models").exists()  # nothing trained
    assert shared_env_status(env, probe=False)["idle"]


def test_catalog_hash_is_checked_too(demo, env, tmp_path):
    """A snapshot whose digest file was rewritten to match the changed bytes still fails
    against the catalog's record (the copy keeps the catalog; its paths point at the copy)."""
    from aml_pipeline.core.hashing import digest_snapshot
    from aml_pipeline.pipeline.publish import Catalog

    copy = tmp_path / "datasets"
    shutil.copytree(demo.datasets_root, copy, symlinks=True)
    snap = (copy / SPEC.id / "current").resolve()
    manifest = json.loads((snap / "manifest.json").read_text())
    Catalog(copy).record(snap, manifest, demo.summary["sha256"], current=True)  # catalog row for the copy
    y = snap / "arrays" / "y.f32"
    y.write_bytes(b"\0" * len(y.read_bytes()))
    (snap / "sha256.json").write_bytes(digest_snapshot(snap).to_json_bytes())
    result = _materialize(env, tmp_path / "home", datasets_dir=copy)
    assert not result.success
    [failure] = step_failures(result)
    assert "SNAPSHOT_TAMPERED" in failure and "recorded in the catalog" in failure


def test_training_is_refused_while_a_rebuild_holds_the_environment(demo, env):
    with LeaseHolder(env, "rebuild_shared_env (run cafebabe)", mode="exclusive"):
        result = _materialize(env, demo.home)
    assert not result.success
    [failure] = step_failures(result)
    assert "ENV_BUSY" in failure and "rebuild_shared_env (run cafebabe)" in failure


def test_training_needs_a_built_environment_and_a_snapshot(demo, tmp_path):
    result = _materialize(env_settings(tmp_path / "nothing"), demo.home)
    [failure] = step_failures(result)
    assert "ENV_MISSING" in failure
    result = _materialize(env_settings(tmp_path / "nothing"), tmp_path / "empty-home")
    [failure] = step_failures(result)
    assert "NO_SNAPSHOT" in failure and "reactor_a/dataset_manifest" in failure
