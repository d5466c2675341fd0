"""The Dagster definitions a build runs, and Dagster's event switches it runs them with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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


# Dagster's own switches for a run over a range of partitions, set for this process's builds (and
# the step processes they start); docs/deployment.md sets them for a deployment's run workers.
BUILD_EVENT_SETTINGS = {
    # One "materialisation planned" event per asset instead of one per partition (half of a
    # chunk's events). The cost: partitions of a failed chunk show as missing rather than failed
    # in the UI, while the run itself shows the failure.
    "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS": "true",
    # A step's per-partition materialisations of one asset are written to the instance in one
    # batch (PostgreSQL: one connection and one insert per batch instead of per event; SQLite
    # storage writes them one by one either way).
    "DAGSTER_EVENT_BATCH_SIZE": "1000",
}


@contextmanager
def build_event_settings() -> Iterator[None]:
    """:data:`BUILD_EVENT_SETTINGS` in the environment for the duration (a value already set wins)."""
    before = {name: os.environ.get(name) for name in BUILD_EVENT_SETTINGS}
    for name, value in BUILD_EVENT_SETTINGS.items():
        os.environ[name] = before[name] or value
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
