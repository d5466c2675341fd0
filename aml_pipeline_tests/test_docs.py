"""The documentation a user reads is in the repository, links where it says, names every spec field
and ingest column the code accepts, and its hash recipe computes the snapshot hash."""

from __future__ import annotations

import re

import pytest
from pydantic.alias_generators import to_camel

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import snapshot_sha256
from aml_pipeline.pipeline.build import build_dataset
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import CleaningSpec, DatasetSpec, ExtrasSpec, NodeSpec, SplitSpec, VariableSpec, parse_spec
from aml_pipeline.tsdb import open_tsdb
from aml_pipeline.tsdb.ingest import NODE_OPTIONAL, NODE_REQUIRED, POINT_COLUMNS, RUN_OPTIONAL, RUN_REQUIRED

DOCS = REPO_ROOT / "docs"


def text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_readme_points_at_docs_in_the_repository_and_runs_commands_that_exist():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "shared/DESIGN.md" not in readme and "DESIGN " not in readme
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO_ROOT / target).is_file(), target
    for name in ("spec.md", "ingest.md", "snapshot.md", "lineage.md"):
        assert f"docs/{name}" in readme, name
    # after the documented set-up, `aml-pipeline` is .venv/bin/aml-pipeline, not on PATH
    for line in readme.splitlines():
        if re.match(r"\s*aml-pipeline ", line):
            pytest.fail(f"README runs a bare aml-pipeline: {line!r}")


def test_every_doc_link_resolves():
    for doc in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).is_file(), f"{doc.name} links {target}"


@pytest.mark.parametrize("model", [DatasetSpec, NodeSpec, CleaningSpec, SplitSpec, ExtrasSpec, VariableSpec])
def test_spec_doc_names_every_field(model):
    doc = text("spec.md")
    for name in model.model_fields:
        assert f"`{to_camel(name)}`" in doc, f"{model.__name__}.{name} ({to_camel(name)}) is not in docs/spec.md"


def test_ingest_doc_names_every_column():
    doc = text("ingest.md")
    for column in (*POINT_COLUMNS, *RUN_REQUIRED, *RUN_OPTIONAL, *NODE_REQUIRED, *NODE_OPTIONAL):
        assert f"`{column}`" in doc, column


@pytest.mark.parametrize("extras", [False, True], ids=["v1", "v2"])
def test_the_documented_hash_recipe_computes_the_snapshot_hash(tmp_path, extras):
    plant = simulate_plant(n_runs=3, run_minutes=4, seed=2)
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    spec = parse_spec(plant_spec_dict(plant, "doc_ds", history_steps=10, horizon_steps=5, extras=extras))
    with open_tsdb(url) as db:
        published = build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=tmp_path / "datasets")
    doc = text("snapshot.md")
    [code] = re.findall(r"In\s+Python:\s*```python\n(.*?)```", doc, flags=re.S)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the documentation's own snippet, under test
    assert scope["snapshot_sha256"](str(published.snapshot_dir)) == published.sha256 == snapshot_sha256(published.snapshot_dir)
    assert published.snapshot_dir.name == published.sha256[:16]  # the layout the doc shows
