"""A plant's own Dagster project adds a dataset as a component, as a user would.

A minimal second project (its own ``pyproject.toml`` and ``defs/`` folder) gets an environment of
its own with this package installed into it (built from the repository's sources; the
dependencies come from this environment through a ``.pth`` file, so nothing is downloaded but the
build backend). ``dg scaffold defs`` writes the dataset's ``defs.yaml``; ``dg check yaml``,
``dg check defs`` and ``dg list defs`` run in the project; a script in the project's environment
materialises the dataset through the project's definitions (its sensor, run-stage job and rebuild
job), and the snapshot is byte for byte the one this repository builds from the same spec.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb

REPO = Path(__file__).resolve().parents[2]
DG = Path(sys.executable).parent / "dg"

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "plant_project"
version = "0.1.0"
requires-python = ">=3.11"

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "plant_project"
"""

DEFINITIONS = """\
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
"""

# What a scheduled deployment does, in one process: the sensor adds the finished runs as
# partitions and asks for their run stages, the rebuild job publishes.
MATERIALIZE = """\
import json
import sys

import dagster as dg

from plant_project.definitions import defs as load_defs

spec_id = sys.argv[1]
defs = load_defs()
with dg.DagsterInstance.ephemeral() as instance:
    sensor = defs.resolve_sensor_def(f"{spec_id}__new_runs")
    with dg.build_sensor_context(instance=instance, resources=defs.resources) as context:
        tick = sensor(context)
    for request in tick.dynamic_partitions_requests:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    runs = defs.resolve_job_def(f"{spec_id}__runs")
    for request in tick.run_requests:
        assert runs.execute_in_process(instance=instance, tags=request.tags, asset_selection=request.asset_selection).success
    rebuild = defs.resolve_job_def(f"{spec_id}__rebuild").execute_in_process(instance=instance)
    [event] = [e for e in rebuild.get_asset_materialization_events() if e.asset_key.path[-1] == "dataset_manifest"]
    print(json.dumps(event.materialization.metadata["summary"].value))
"""


# The plant's daily retention job, as the daemon runs it: through the project's definitions.
GC = """\
import dagster as dg

from plant_project.definitions import defs as load_defs

with dg.DagsterInstance.ephemeral() as instance:
    assert load_defs().resolve_job_def("aml_gc").execute_in_process(instance=instance).success
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The second project, with its environment: this package installed from a copy of the
    repository's sources (pip would otherwise leave build files in the repository)."""
    root = tmp_path_factory.mktemp("plant_project")
    package = root / "plant_project"
    (package / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (package / "__init__.py").write_text("")
    (package / "defs" / "__init__.py").write_text("")
    (package / "definitions.py").write_text(DEFINITIONS)
    (root / "materialize.py").write_text(MATERIALIZE)
    (root / "gc.py").write_text(GC)

    source = tmp_path_factory.mktemp("aml_pipeline_source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "aml_pipeline", source / "aml_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (purelib / "aml_pipeline_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(source)],
                   check=True, timeout=600)
    return root


def _env(project: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    venv = project / ".venv"
    return {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
            "DAGSTER_HOME": str(home), **extra}


def _dg(project: Path, env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(DG), *args], cwd=project, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, f"dg {' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done


def test_a_dataset_added_to_another_project_builds_the_same_snapshot(project: Path, tmp_path: Path) -> None:
    installed = subprocess.run([str(project / ".venv" / "bin" / "python"), "-c", "import aml_pipeline; print(aml_pipeline.__file__)"],
                               cwd=project, capture_output=True, text=True, check=True).stdout
    assert installed.startswith(str(project / ".venv")), installed  # its own copy, not this repository's

    plant = simulate_plant(n_runs=4, run_minutes=8, seed=5)
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    env = _env(project, tmp_path, AML_TSDB_URL=url, AML_HOME=str(tmp_path / "plant_home"))

    # The component is known, and scaffolding writes a commented starter spec that validates.
    assert "aml_pipeline.components.AmlDataset" in _dg(project, env, "list", "components").stdout
    _dg(project, env, "scaffold", "defs", "aml_pipeline.components.AmlDataset", "reactor_b")
    _dg(project, env, "scaffold", "defs", "aml_pipeline.components.AmlPlant", "plant")
    dataset_yaml = project / "plant_project" / "defs" / "reactor_b" / "defs.yaml"
    starter = dataset_yaml.read_text()
    assert "id: reactor_b" in starter and "the asset key prefix" in starter and "AML_TSDB_URL" in starter
    _dg(project, env, "check", "yaml")  # the starter validates as it is

    # The dataset: a spec of the plant, written as a user writes it into defs.yaml.
    spec = plant_spec_dict(plant, "reactor_b", history_steps=20, horizon_steps=10)
    dataset_yaml.write_text(yaml.safe_dump({"type": "aml_pipeline.components.AmlDataset", "attributes": {"spec": spec}},
                                           sort_keys=False))
    _dg(project, env, "check", "yaml")
    _dg(project, env, "check", "defs")
    listed = json.loads(_dg(project, env, "list", "defs", "--json").stdout)
    assets = {a["asset_key"] for a in listed["assets"]}
    assert {f"reactor_b/{n}" for n in ("raw_node_series", "cleaned_grid", "run_windows", "dataset_split",
                                        "normalization_stats", "dataset_manifest")} <= assets
    assert {"tsdb/points", "shared_env"} <= assets
    assert [s["name"] for s in listed["sensors"]] == ["reactor_b__new_runs"]
    assert {"reactor_b__runs", "reactor_b__build", "reactor_b__rebuild", "reactor_b__verify"} <= {j["name"] for j in listed["jobs"]}
    assert {"reactor_b__rebuild_schedule", "reactor_b__verify_schedule"} <= {s["name"] for s in listed["schedules"]}

    # Materialised through the other project's definitions: the snapshot this repository builds.
    done = subprocess.run([str(project / ".venv" / "bin" / "python"), "materialize.py", "reactor_b"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = materialize_dataset(parse_spec(spec), tsdb_url=url, home=tmp_path / "repo_home")
    assert theirs["current"] and theirs["manifestVersion"] == 1
    assert theirs["sha256"] == ours["sha256"]

    # The plant's gc knows the dataset of the defs.yaml: after an edit of its cleaning, the aml_gc
    # job of the project removes the cleaned grids built for the old spec, and keeps the raw
    # series, which the edit does not change.
    runs = tmp_path / "plant_home" / "store" / "reactor_b" / "runs"
    built = sorted(runs.glob("*/grid.json"))
    assert built and len(sorted(runs.glob("*/raw.json"))) == len(built)
    spec["cleaning"] = {**spec.get("cleaning", {}), "hampelK": 7}
    dataset_yaml.write_text(yaml.safe_dump({"type": "aml_pipeline.components.AmlDataset", "attributes": {"spec": spec}},
                                           sort_keys=False))
    done = subprocess.run([str(project / ".venv" / "bin" / "python"), "gc.py"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not sorted(runs.glob("*/grid.*")) and not sorted(runs.glob("*/windows.*")), "gc left the old grids"
    assert sorted(runs.glob("*/raw.json")) == [p.with_name("raw.json") for p in built]


def test_a_bad_attribute_fails_dg_check_yaml_naming_the_field(project: Path, tmp_path: Path) -> None:
    defs = project / "plant_project" / "defs" / "bad_one"
    defs.mkdir(parents=True, exist_ok=True)
    spec = {"id": "bad_one", "lineId": "L1", "productId": "P1", "recipeId": "R1",
            "nodes": [{"nodeId": "A", "role": "target"}], "cleaning": {"hampleK": 5}}
    (defs / "defs.yaml").write_text(yaml.safe_dump({"type": "aml_pipeline.components.AmlDataset",
                                                   "attributes": {"spec": spec}}))
    try:
        # The file named: Dagster 1.13's `dg check yaml` keeps one file per component type when it
        # checks the whole project (the last it finds), so two datasets may hide one another.
        done = _dg(project, _env(project, tmp_path), "check", "yaml", str(defs), check=False)
    finally:
        shutil.rmtree(defs)
    assert done.returncode != 0
    assert "hampleK" in done.stdout + done.stderr and "not allowed" in done.stdout + done.stderr
