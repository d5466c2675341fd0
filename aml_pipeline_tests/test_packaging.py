"""The package as a plant installs it: a built wheel (not the editable checkout) in a fresh
``create-dagster`` project's environment, with none of this repository's files around.

The wheel is built from a copy of the sources; the project is made by ``create-dagster`` from the
registry (the newest Dagster 1.13, which pip's cache and ``find-links`` keep from being fetched
twice). Installing the wheel must leave the project's Dagster where it was, with ``pip check``
clean; then the demo runs in an empty folder, its snapshot verifies, and the project loads the
demo's spec through ``AmlSpecFolder`` at the layout ``create-dagster`` makes (``src/<project>/defs``).
Also: ``requirements/constraints.txt`` (CI's lock) pins every installed package, within the
ranges ``pyproject.toml`` declares.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from aml_pipeline.config import REPO_ROOT

pytestmark = pytest.mark.timeout(3600)

PROJECT = "plant"


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPO_ROOT / "requirements" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def packages_under_test() -> dict[str, Version]:
    """The packages the test environment installs (``scripts/setup.sh test``: aml_pipeline with
    its ui, deploy and test extras, and what they require), at their installed versions."""
    found: dict[str, Version] = {}
    todo = [(Requirement("aml_pipeline[ui,deploy,test]"), "")]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        dist = metadata.distribution(requirement.name)
        wanted = {canonicalize_name(e) for e in requirement.extras}
        if name in found and not wanted:
            continue
        found[name] = Version(dist.version)
        for line in dist.requires or []:
            dependency = Requirement(line)
            for option in wanted or {""}:
                todo.append((dependency, option))
    return found


def test_the_constraints_pin_every_installed_package_within_the_declared_ranges() -> None:
    pins = constraints()
    installed = packages_under_test()
    unpinned = sorted(set(installed) - set(pins) - {"aml-pipeline", "torch"})
    assert not unpinned, f"installed but not pinned in requirements/constraints.txt: {unpinned}"
    moved = {n: (str(installed[n]), str(v)) for n, v in pins.items() if n in installed and installed[n].public != str(v)}
    assert not moved, f"installed at another version than pinned: {moved}"
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = [Requirement(r) for r in project["dependencies"] + extras["ui"] + extras["deploy"]
                if not r.startswith("aml_pipeline")]
    outside = [f"{r} (pinned {pins[canonicalize_name(r.name)]})" for r in declared
               if not r.specifier.contains(pins[canonicalize_name(r.name)])]
    assert not outside, outside
    # a plant's Dagster 1.13 project keeps its Dagster: every dagster package is a range, not a pin
    exact = [str(r) for r in declared if r.name.startswith("dagster") and any(s.operator == "==" for s in r.specifier)]
    assert not exact, exact


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 1500) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} in {cwd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_wheel_installs_into_a_fresh_dagster_project_and_runs_the_demo(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_", "VIRTUAL_ENV", "PYTHON"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    # The wheel, built from a copy of the sources (a build in place would leave build/ behind).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "aml_pipeline", source / "aml_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(source)],
        tmp_path, env)
    [wheel] = (tmp_path / "dist").glob("aml_pipeline-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "aml_pipeline"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = sorted(p for p in tracked if p not in shipped)
    assert not missing, f"files of the package the wheel does not ship: {missing}"

    # A fresh project, as `create-dagster project` makes it (the tool in an environment of its own,
    # as `uvx create-dagster` keeps it), and the project installed into its own environment.
    tools, venv = tmp_path / "tools", tmp_path / "venv"
    for where in (tools, venv):
        run([sys.executable, "-m", "venv", str(where)], tmp_path, env)
        run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], tmp_path, env)
    run([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", "create-dagster<1.14"], tmp_path, env)
    run([str(tools / "bin" / "create-dagster"), "project", PROJECT, "--no-uv-sync"], tmp_path, env)
    project = tmp_path / PROJECT
    pip, python = [str(venv / "bin" / "python"), "-m", "pip"], str(venv / "bin" / "python")
    run([*pip, "install", "--quiet", "-e", str(project)], tmp_path, env)
    version = "import importlib.metadata as m; print(m.version('dagster'))"
    before = run([python, "-c", version], tmp_path, env).stdout.strip()
    assert before.startswith("1.13."), before

    run([*pip, "install", "--quiet", str(wheel)], tmp_path, env)
    assert run([python, "-c", version], tmp_path, env).stdout.strip() == before  # its Dagster, unchanged
    run([*pip, "check"], tmp_path, env)
    installed = run([python, "-c", "import aml_pipeline; print(aml_pipeline.__file__)"], tmp_path, env).stdout
    assert installed.startswith(str(venv)), installed

    # The demo in an empty folder: the example spec comes from the package, the hints name what
    # an installed user has.
    trial = tmp_path / "trial"
    trial.mkdir()
    user = {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}"}
    demo = run([str(venv / "bin" / "aml-pipeline"), "demo", "--home", str(trial), "--runs", "5"], trial, user)
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert summary["current"] and Path(summary["snapshotDir"]).is_relative_to(trial / "datasets"), summary
    spec = trial / "specs" / "reactor_a.yaml"
    assert spec.read_bytes() == (REPO_ROOT / "specs" / "reactor_a.yaml").read_bytes()
    hints = demo.stderr[demo.stderr.index("next:"):]
    assert "scripts/ui.sh" not in hints and ".venv/bin" not in hints, hints
    assert f"aml-pipeline verify {summary['snapshotDir']}" in hints and "dg dev" in hints, hints
    assert f"aml-pipeline baseline {spec} --root {trial / 'datasets'}" in hints, hints
    assert demo.stderr.strip().splitlines()[-1].startswith("not recorded in a Dagster instance"), demo.stderr
    verified = run([str(venv / "bin" / "aml-pipeline"), "verify", summary["snapshotDir"]], trial, user)
    assert verified.stdout.startswith(f"OK {summary['sha256']}")
    baseline = run([str(venv / "bin" / "aml-pipeline"), "baseline", str(spec), "--root", str(trial / "datasets")], trial, user)
    assert "RMSE" in baseline.stdout

    # The project loads the demo's spec folder at create-dagster's layout, as docs/dagster.md says
    # (written as `dg scaffold defs aml_pipeline.components.AmlSpecFolder datasets` writes it, and
    # validated by Dagster's own command, as `dg check defs` does: the project's development tools
    # are not needed for this).
    in_project = {**user, "AML_HOME": str(trial)}
    defs_yaml = project / "src" / PROJECT / "defs" / "datasets" / "defs.yaml"
    defs_yaml.parent.mkdir(parents=True)
    validate = [str(venv / "bin" / "dagster"), "definitions", "validate", "-m", f"{PROJECT}.definitions"]
    defs_yaml.write_text(yaml.safe_dump({"type": "aml_pipeline.components.AmlSpecFolder",
                                         "attributes": {"path": str(spec.parent)}}))
    loaded = run(validate, project, in_project)
    assert "Validation successful for code location" in loaded.stdout + loaded.stderr, loaded.stderr
    listed = run([python, "-c", f"from {PROJECT}.definitions import defs; "
                  "print(sorted(k.to_user_string() for k in defs().resolve_all_asset_keys()))"], project, in_project)
    assert "reactor_a/dataset_manifest" in listed.stdout, listed.stdout

    # With no attributes, the folder is specs/ in the project root, which is not there: one line
    # naming it, and no success.
    defs_yaml.write_text(yaml.safe_dump({"type": "aml_pipeline.components.AmlSpecFolder"}))
    failed = subprocess.run(validate, cwd=project, env=in_project, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert f"SPEC_INVALID: AmlSpecFolder: specs folder {project / 'specs'} does not exist" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr and "Stack Trace" not in failed.stderr
