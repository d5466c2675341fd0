"""The starter ``defs.yaml`` that ``dg scaffold defs aml_pipeline.components.AmlDataset`` writes
(the scaffold itself is run in test_project.py)."""

from __future__ import annotations

import yaml

from aml_pipeline.components.dataset import starter_defs_yaml
from aml_pipeline.spec import CleaningSpec, SplitSpec, parse_spec


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
