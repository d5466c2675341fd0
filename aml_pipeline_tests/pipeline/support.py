"""Helpers of the pipeline tests that read a dataset's store."""

from __future__ import annotations

from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.pipeline.store import DatasetStore


def stage_runs(store: DatasetStore, stage: Stage) -> list[str]:
    """Runs of ``store`` that have a finished ``stage``."""
    runs = store.dir / "runs"
    if not runs.is_dir():
        return []
    return sorted(p.name for p in runs.iterdir() if store.meta_path(p.name, stage).is_file())
