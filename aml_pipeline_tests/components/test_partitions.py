"""Materialising without the UI, as docs/dagster.md shows it: `dg launch` over a range of run
partitions (one Dagster run for the range: the run stages' single-run backfill policy), then
`dg launch --job <id>__rebuild`, in this repository's code location on a persistent instance."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg

from aml_pipeline import config
from aml_pipeline.config import REPO_ROOT
from aml_pipeline.demo import DEMO_SPEC, seed_demo
from aml_pipeline.pipeline.registry import RUN_ASSETS

DG = Path(sys.executable).parent / "dg"
SPEC_ID = "reactor_a"


def test_dg_launch_builds_a_range_of_run_partitions_in_one_run_then_the_rebuild_publishes(tmp_path: Path) -> None:
    home, specs, dagster_home = tmp_path / "aml", tmp_path / "specs", tmp_path / "dagster_home"
    for d in (home, specs, dagster_home):
        d.mkdir()
    shutil.copy(DEMO_SPEC, specs / DEMO_SPEC.name)
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    assert seed_demo(config.default_tsdb_url(home), runs=6).written > 0
    runs = [f"L1-P100-{i:04d}" for i in range(1, 6)]  # the finished ones; the sixth is in progress
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    env.update(DAGSTER_HOME=str(dagster_home), AML_HOME=str(home), AML_SPECS=str(specs),
               VIRTUAL_ENV=str(Path(sys.executable).parents[1]))

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        # Run partitions exist once added (the sensor's tick adds them); as the sensor would.
        instance.add_dynamic_partitions(f"{SPEC_ID}__runs", runs)

    def launch(*args: str) -> None:
        done = subprocess.run([str(DG), "launch", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"dg launch {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    selection = ",".join(f"{SPEC_ID}/{name}" for name in RUN_ASSETS)
    launch("--assets", selection, "--partition-range", f"{runs[1]}...{runs[3]}")
    launch("--job", f"{SPEC_ID}__rebuild")

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        for name in RUN_ASSETS:
            assert instance.get_materialized_partitions(dg.AssetKey([SPEC_ID, name])) == set(runs[1:4]), name
        records = instance.fetch_materializations(dg.AssetKey([SPEC_ID, "run_windows"]), limit=10).records
        assert len({r.run_id for r in records}) == 1  # the range in one Dagster run
        [manifest] = instance.fetch_materializations(dg.AssetKey([SPEC_ID, "dataset_manifest"]), limit=5).records
        summary = manifest.asset_materialization.metadata["summary"].value
        assert summary["current"] and sum(summary["runs"][p] for p in ("train", "val", "test")) == 3, summary
        assert summary["runs"]["excluded"] == 2, summary  # the two runs not built, with their reason
