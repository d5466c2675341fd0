"""docs/sources.md names every key the description accepts, and every recipe in it is a valid
description."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.sources.description import (
    BatchTag,
    NodeEntry,
    NodeTable,
    Partition,
    Periods,
    Points,
    Quality,
    Runs,
    Security,
    SourceDescription,
    WideColumn,
    Windows,
    parse_description,
)

DOC = (REPO_ROOT / "docs" / "sources.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("model", [SourceDescription, Security, Points, Quality, WideColumn, Periods, Partition, Runs,
                                   BatchTag, Windows, NodeTable, NodeEntry])
def test_every_key_is_documented(model):
    for name in model.model_fields:
        assert f"`{name}`" in DOC or re.search(rf"`[a-z_.]*\b{name}\b", DOC), f"{model.__name__}.{name}"


RECIPES = re.findall(r"```yaml\n(.*?)```", DOC, flags=re.S)


def test_there_is_a_recipe_per_layout():
    assert len(RECIPES) >= 8


@pytest.mark.parametrize("recipe", RECIPES, ids=[f"recipe{i}" for i in range(len(RECIPES))])
def test_each_recipe_is_a_valid_description(recipe, monkeypatch):
    data = yaml.safe_load(recipe)
    if set(data) == {"quality"}:  # the quality fragment
        Quality.model_validate(data["quality"])
        return
    parse_description(data, Path("/etc/aml/recipe.yaml"))


def test_tsdb_and_readme_point_here():
    assert "sources.md" in (REPO_ROOT / "docs" / "tsdb.md").read_text(encoding="utf-8")
    assert "docs/sources.md" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")
