"""The demo as `scripts/demo.sh` runs it: recorded in the persistent Dagster instance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg

from aml_pipeline.config import REPO_ROOT


def test_demo_records_its_materialisations_in_the_persistent_instance(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")  # relative storage paths: cwd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    env.update(DAGSTER_HOME=str(home), AML_HOME=str(tmp_path / ".aml"))
    proc = subprocess.run(
        [sys.executable, "-m", "aml_pipeline.cli", "demo", "--runs", "5", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["current"] and Path(summary["snapshotDir"]).is_dir()

    os.environ["DAGSTER_HOME"] = str(home)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # the repository's dagster.yaml keeps storage relative to the cwd
        with dg.DagsterInstance.get() as instance:
            partitions = instance.get_dynamic_partitions("reactor_a__runs")
            assert len(partitions) == summary["runs"]["train"] + summary["runs"]["val"] + summary["runs"]["test"] + summary["runs"]["excluded"]
            assert instance.get_materialized_partitions(dg.AssetKey(["reactor_a", "run_windows"])) == set(partitions)
            record = instance.fetch_materializations(dg.AssetKey(["reactor_a", "dataset_manifest"]), limit=1).records[0]
            assert record.asset_materialization.metadata["sha256"].value == summary["sha256"]
            check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
                [dg.AssetCheckKey(dg.AssetKey(["reactor_a", "dataset_manifest"]), "hash_verifies")]
            )
            [execution] = check.values()
            assert execution.status.value == "SUCCEEDED"
    finally:
        os.chdir(cwd)
        del os.environ["DAGSTER_HOME"]
    assert (tmp_path / ".aml" / "dagster" / "storage").is_dir()
