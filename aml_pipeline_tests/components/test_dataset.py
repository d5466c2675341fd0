"""The dataset components: the starter ``defs.yaml`` that ``dg scaffold defs
aml_pipeline.components.AmlDataset`` writes (the scaffold itself is run in test_project.py), and
the spec folder failing closed: `dg check defs` in this repository (whose code location loads its
specs through ``AmlSpecFolder``) with the folder missing, empty, or holding an invalid spec."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from aml_pipeline.components.dataset import spec_folder, starter_defs_yaml
from aml_pipeline.config import REPO_ROOT
from aml_pipeline.demo import DEMO_SPEC
from aml_pipeline.spec import CleaningSpec, SplitSpec, parse_spec

DG = Path(sys.executable).parent / "dg"
BAD_SPEC = "id: bad\nlineId: L1\nproductId: P1\nrecipeId: R1\nnodes: [{nodeId: A, role: target}]\ncleaning: {hampleK: 5}\n"


def check_defs(specs: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    env.update(AML_SPECS=str(specs), AML_HOME=str(tmp_path / "aml"), VIRTUAL_ENV=str(Path(sys.executable).parents[1]))
    return subprocess.run([str(DG), "check", "defs"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("case", ["missing", "empty", "bad spec"])
def test_dg_check_defs_fails_with_one_line_naming_the_folder_or_the_file(tmp_path: Path, case: str) -> None:
    specs = tmp_path / "specs"
    if case != "missing":
        specs.mkdir()
    if case == "bad spec":
        shutil.copy(DEMO_SPEC, specs / DEMO_SPEC.name)  # a good one beside it does not hide the bad one
        (specs / "bad.yaml").write_text(BAD_SPEC)
    done = check_defs(specs, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Stack Trace" not in done.stderr, done.stderr
    assert "All definitions loaded successfully" not in done.stdout
    [line] = [x for x in done.stderr.splitlines() if x.startswith("SPEC_INVALID: ")]
    expected = {
        "missing": f"SPEC_INVALID: AmlSpecFolder: specs folder {specs} does not exist (AML_SPECS)",
        "empty": f"SPEC_INVALID: AmlSpecFolder: specs folder {specs} holds no spec file (*.yaml, *.yml) (AML_SPECS)",
        "bad spec": f"SPEC_INVALID: {specs / 'bad.yaml'}: field cleaning.hampleK: unknown key; did you mean hampelK?",
    }[case]
    assert line.startswith(expected), line


def test_dg_check_defs_passes_on_a_folder_of_good_specs(tmp_path: Path) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(DEMO_SPEC, specs / DEMO_SPEC.name)
    done = check_defs(specs, tmp_path)
    assert done.returncode == 0 and "All definitions loaded successfully" in done.stdout, done.stdout + done.stderr


def test_the_folder_is_relative_to_the_project_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AML_SPECS", str(tmp_path / "from_env"))
    assert spec_folder("datasets", tmp_path) == tmp_path / "datasets"  # the attribute wins
    assert spec_folder(str(tmp_path / "abs"), Path("/elsewhere")) == tmp_path / "abs"
    assert spec_folder(None, tmp_path) == tmp_path / "from_env"
    monkeypatch.delenv("AML_SPECS")
    assert spec_folder(None, tmp_path) == tmp_path / "specs"


def test_the_starter_shows_the_spec_models_defaults_with_every_cleaning_and_split_key() -> None:
    text = starter_defs_yaml("aml_pipeline.components.AmlDataset", "reactor_b")
    doc = yaml.safe_load(text)
    assert doc["type"] == "aml_pipeline.components.AmlDataset"
    spec = doc["attributes"]["spec"]
    assert spec["id"] == "reactor_b" and "# grid period" in text and "# H" in text
    # What it sets beyond the required keys are the model's defaults: as if it had not set them.
    required = {k: spec[k] for k in ("id", "lineId", "productId", "recipeId", "nodes")}
    assert set(spec) - set(required) == {"beatMs", "maxInterpMs", "historySteps", "horizonSteps", "stride",
                                         "cleaning", "split"}
    assert parse_spec(spec).to_json_dict() == parse_spec(required).to_json_dict()
    assert list(spec["cleaning"]) == [f.alias for f in CleaningSpec.model_fields.values()]
    assert list(spec["split"]) == [f.alias for f in SplitSpec.model_fields.values()]
