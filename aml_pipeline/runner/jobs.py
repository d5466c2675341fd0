"""The Dagster definitions a build runs."""

from __future__ import annotations

from typing import Any

import dagster as dg

from aml_pipeline.components.dataset import dataset_definitions
from aml_pipeline.components.resources import plant_resources
from aml_pipeline.components.sources import tsdb_points
from aml_pipeline.pipeline.registry import StageVersions
from aml_pipeline.spec import DatasetSpec


def dataset_job_definitions(spec: DatasetSpec, resources: dict[str, Any],
                            versions: StageVersions | None = None) -> dg.Definitions:
    """The spec's definitions (as the code location has them) with these resources."""
    return dg.Definitions.merge(
        dataset_definitions(spec, versions),
        dg.Definitions(assets=[tsdb_points], resources={**plant_resources(), **resources}),
    )
