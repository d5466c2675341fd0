"""The demo as `scripts/demo.sh` runs it: recorded in the persistent Dagster instance."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.simulate.plant import simulate_plant
from aml_pipeline.tsdb_open import open_tsdb


def test_demo_records_its_materialisations_in_the_persistent_instance(tmp_path, monkeypatch):
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

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with monkeypatch.context() as cwd:
        cwd.chdir(tmp_path)  # the repository's dagster.yaml keeps storage relative to the cwd
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
            # the TSDB source was observed after seeding: its watermark is in the UI
            [observation] = instance.fetch_observations(dg.AssetKey(["tsdb", "points"]), limit=5).records
            with open_tsdb(f"duckdb://{tmp_path / '.aml' / 'tsdb.duckdb'}") as db:
                assert observation.asset_observation.data_version == str(db.availability_watermark())
    assert (tmp_path / ".aml" / "dagster" / "storage").is_dir()

    # what it said: why 5 seeded runs give 4, why lineage will be 0, what to do next
    err = proc.stderr
    assert "5 runs in the TSDB; 4 finished runs in the scope of reactor_a (line L1, product P100, recipe R7, any time)" in err
    assert "L1-P100-0005 is still running" in err
    assert "L1-P100-0003 has no confirmed context, so lineageVerified will be 0" in err
    assert "scripts/ui.sh" in err and f"aml-pipeline verify {summary['snapshotDir']}" in err
    assert "aml-pipeline baseline specs/reactor_a.yaml" in err

    # another number of runs re-seeds the demo's own TSDB file and builds exactly those
    again = subprocess.run(
        [sys.executable, "-m", "aml_pipeline.cli", "demo", "--runs", "4", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "it held the 5 runs of an earlier demo: re-seeded with 4 runs" in again.stderr
    smaller = json.loads(again.stdout.strip().splitlines()[-1])
    assert sum(smaller["runs"].values()) == 3 and smaller["current"]
    assert "val and test have no runs: the chronological split of 3 runs gives floor(3 x 0.15) = 0 for val" in again.stderr
    assert "(docs/spec.md, split); 7 runs with windows give each at least one" in again.stderr
    assert "--runs 8 seeds 7 finished runs" in again.stderr
    with open_tsdb(f"duckdb://{tmp_path / '.aml' / 'tsdb.duckdb'}") as db:
        assert len(db.list_runs(None, finished_only=False)) == 4


def test_the_demo_never_reseeds_a_tsdb_that_is_not_its_own(tmp_path):
    """With AML_TSDB_URL pointing elsewhere, a TSDB holding other runs is refused, untouched."""
    url = f"duckdb://{tmp_path / 'plant.duckdb'}"
    plant = simulate_plant(n_runs=2, run_minutes=2, seed=3, line_id="L2")
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    env.update(AML_HOME=str(tmp_path / ".aml"), AML_TSDB_URL=url)
    proc = subprocess.run(
        [sys.executable, "-m", "aml_pipeline.cli", "demo", "--runs", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("DEMO_TSDB_IN_USE: ") and "2 runs that are not the demo's" in last
    with open_tsdb(url) as db:
        assert sorted(r.run_id for r in db.list_runs(None, finished_only=False)) == sorted(r.run_id for r in plant.runs)


def readme_demo_transcript() -> list[str]:
    """The lines of the README's "The demo prints" block."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    [block] = re.findall(r"The demo prints[^\n]*\n(?:[^\n]*\n)*?```text\n(.*?)```", readme, flags=re.S)
    return block.splitlines()


def transcript_pattern(line: str) -> re.Pattern[str] | None:
    """A README line as a pattern of the demo's line: ``…`` in a path and ``...`` stand for
    anything, a hash (16 or more hex digits) for any hash; None for an elided line (``  ...``)."""
    if line.strip() in ("", "...", "…"):
        return None
    parts = re.split(r"(…|\.\.\.|[0-9a-f]{16,})", re.sub(r"[0-9a-f]+…", "…", line))
    regex = "".join(".*" if p in ("…", "...") else "[0-9a-f]+" if re.fullmatch(r"[0-9a-f]{16,}", p) else re.escape(p)
                    for p in parts)
    return re.compile(regex)


def test_the_readme_shows_what_the_demo_prints_and_build_home_reads_the_demo_s_tsdb(tmp_path):
    """``scripts/demo.sh`` (the demo with DAGSTER_HOME set) prints every line the README shows,
    in that order; then ``build --home`` naming the demo's home, run from another directory, reads
    the TSDB the demo seeded there (not that directory's ./.aml) and publishes nothing new (the
    repository's dagster.yaml keeps the instance relative to the working directory, so the runs
    are materialised again there, into the same snapshot)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    env.update(DAGSTER_HOME=str(home))
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    demo = subprocess.run([sys.executable, "-m", "aml_pipeline.cli", "demo"],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    printed = (demo.stderr + demo.stdout).splitlines()
    # stderr and stdout are captured apart: each README line is matched in order within its stream
    streams = {"err": demo.stderr.splitlines(), "out": demo.stdout.splitlines()}
    at = {"err": 0, "out": 0}
    shown = [line for line in readme_demo_transcript() if transcript_pattern(line) is not None]
    assert len(shown) >= 12
    for line in shown:
        pattern = transcript_pattern(line)
        for name, lines in streams.items():
            found = next((i for i in range(at[name], len(lines)) if pattern.fullmatch(lines[i])), None)
            if found is not None:
                at[name] = found + 1
                break
        else:
            raise AssertionError(f"the README shows {line!r}; the demo printed:\n" + "\n".join(printed))
    # and it shows every line the demo prints before its suggestions ("next:", elided there)
    patterns = [transcript_pattern(line) for line in shown]
    told = streams["err"][:streams["err"].index("next:")] + streams["out"]
    missing = [line for line in told if not any(p.fullmatch(line) for p in patterns)]
    assert not missing, f"the demo prints lines the README does not show: {missing}"

    # the demo's home named from elsewhere: its TSDB, store and datasets, nothing new to publish
    build = subprocess.run([sys.executable, "-m", "aml_pipeline.cli", "build", str(REPO_ROOT / "specs" / "reactor_a.yaml"),
                            "--home", str(here / ".aml"), "--json"], cwd=elsewhere, env=env, capture_output=True,
                           text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    summary = json.loads(build.stdout.strip().splitlines()[-1])
    demo_summary = json.loads(streams["out"][-1])
    assert summary["published"] is False and summary["snapshotDir"] == demo_summary["snapshotDir"]
    assert Path(summary["snapshotDir"]).parent == here / ".aml" / "datasets" / "reactor_a"
    # (the instance's storage is there, as the repository's dagster.yaml says; nothing else)
    assert not any((elsewhere / ".aml" / name).exists() for name in ("tsdb.duckdb", "store", "datasets"))
